"""Part "kernel" of `python -m vertumnus_jax.gpu_check`: the kernel against the reference.

Cases, with `n` the base length (4096 on the GPU, 256 in a dry run) and Qwen3-8B heads (32 q /
8 kv, head_dim 128) unless named otherwise, inputs standard normal in bf16:
  causal         n queries over n keys, positions 0..n-1;
  cached_prefix  the last n/4 tokens as queries over a cached prefix of 3n/4 (all n keys);
  zigzag         rank 1 of a CP-4 zigzag: queries are chunks 1 and 6 of n/2 new tokens after
                 an unaligned cached prefix; keys are the prefix, a padding gap (the engine's
                 prefix bucket) and every rank's new tokens in all-gather (rank) order;
  gqa_d64        16 query heads per KV head, head_dim 64, n/2 new tokens after n/4 cached;
  padding        batch 2, ragged lengths (not multiples of the tiles), padding queries in the
                 middle and at the end (rows that see nothing), a padding gap among the keys.

Tolerance (`TOLERANCES`, for bf16 / f16): every element `|out - ref| <= 1e-2 + 1.5e-2 |ref|`
and every finite LSE `|lse - ref_lse| <= 2e-3`; no NaN; rows the reference leaves empty
(LSE -inf) are exactly the kernel's -inf rows and are zero. Why: bf16 keeps 8 significant bits;
the kernel rounds P to bf16 before P.V (relative error 2^-9 per weight, so the f32 results of
kernel and reference differ by well under one bf16 step of the output) and both sides round the
output to bf16, so the two outputs differ by at most one bf16 step, 2^-7 |ref| at worst (at a
power of two). That is <= 0.52 of the bound for any |ref| (0.45 at |ref| = 4): a factor of two
left. The dry run's worst case uses 0.31 of it. An output scaled by 1.02 fails wherever
|ref| > 2. The LSE comes from the same bf16 products summed in float32 and agrees to ~1e-5
(1e-6 in interpret mode). f32 is not checked here: the kernel's dots ask for IEEE float32
precision, so the compiled unit tests hold it to 1e-5 on the GPU too.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.reference import attention_reference

# dtype -> (out atol, out rtol, lse atol)
TOLERANCES = {"bfloat16": (1e-2, 1.5e-2, 2e-3), "float16": (1e-2, 1.5e-2, 2e-3),
              "float32": (1e-5, 1e-5, 1e-5)}


def _rng_qkv(rng, batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype):
    q = rng.standard_normal((batch, q_len, q_heads, head_dim), np.float32)
    k = rng.standard_normal((batch, kv_len, kv_heads, head_dim), np.float32)
    v = rng.standard_normal((batch, kv_len, kv_heads, head_dim), np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _pad(x, length):
    return np.concatenate([np.asarray(x, np.int64), -np.ones(length - len(x), np.int64)])


def zigzag_positions(h: int, n_new: int, cp: int, rank: int, gap: int = 0):
    """Rank `rank`'s query positions (chunks r and 2C-1-r of the n_new tokens after h cached)
    and its key positions: prefix 0..h-1, `gap` padding keys, every rank's new tokens in rank
    order."""
    chunks = np.split(h + np.arange(n_new), 2 * cp)
    per_rank = [np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)]
    return per_rank[rank], np.concatenate([np.arange(h), -np.ones(gap, np.int64), *per_rank])


def kernel_cases(n: int, heads: tuple[int, int, int], dtype: str, seed: int = 0) -> list[dict]:
    """The cases above: dicts with name, what, q, k, v, q_positions, kv_positions."""
    hq, hkv, d = heads
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    cases = []

    def add(name, what, q_pos, kv_pos, q_heads=hq, kv_heads=hkv, head_dim=d):
        q_pos, kv_pos = np.atleast_2d(q_pos), np.atleast_2d(kv_pos)
        q, k, v = _rng_qkv(rng, q_pos.shape[0], q_pos.shape[1], kv_pos.shape[1], q_heads,
                           kv_heads, head_dim, dt)
        cases.append(dict(name=name, what=what, q=q, k=k, v=v,
                          q_positions=jnp.asarray(q_pos, jnp.int32),
                          kv_positions=jnp.asarray(kv_pos, jnp.int32)))

    add("causal", f"{n} causal", np.arange(n), np.arange(n))
    new = n // 4
    add("cached_prefix", f"{new} new after {n - new} cached", np.arange(n - new, n),
        np.arange(n))
    h = n // 4 + n // 64 + 3  # not a multiple of any tile
    q_pos, kv_pos = zigzag_positions(h, n // 2, 4, 1, gap=n // 8 - 3)
    add("zigzag", f"CP-4 rank 1, {n // 2} new after {h} cached", q_pos, kv_pos)
    g_heads = max(1, hq // 16)
    add("gqa_d64", f"{hq}/{g_heads} heads, d=64, {n // 2} new after {n // 4}",
        np.arange(n // 4, n // 4 + n // 2), np.arange(n // 4 + n // 2), hq, g_heads, 64)
    # padding: row 0 has padding queries in the middle and at the end and a padding gap among
    # the keys; row 1 a shorter prompt; q_len and kv_len are not multiples of the tiles.
    q_len, h0, n0, gap = n // 4 + 37, n // 2 + 11, n // 4, n // 16
    q0 = _pad(h0 + np.arange(n0), q_len)
    q0[[3, n0 // 2]] = -1
    kv0 = np.concatenate([np.arange(h0), -np.ones(gap, np.int64), h0 + np.arange(n0)])
    kv_len = len(kv0) + 5
    h1, n1 = n // 3, n // 8
    q1 = _pad(h1 + np.arange(n1), q_len)
    kv1 = _pad(np.arange(h1 + n1), kv_len)
    add("padding", f"batch 2, ragged (q_len {q_len}, kv_len {kv_len}), padding rows and gap",
        np.stack([q0, q1]), np.stack([_pad(kv0, kv_len), kv1]))
    return cases


def check_tolerance(out, lse, ref_out, ref_lse, dtype: str) -> dict:
    """Compares a kernel result with the reference under `TOLERANCES[dtype]`.

    Returns max_abs_err, max_rel_err (max |out - ref| / max |ref|), worst_ratio (the largest
    |out - ref| / (atol + rtol |ref|); <= 1 passes), lse_max_abs_err (finite rows), nan,
    empty_rows_ok, and `pass`.
    """
    atol, rtol, lse_atol = TOLERANCES[str(dtype)]
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    lse, ref_lse = np.asarray(lse, np.float32), np.asarray(ref_lse, np.float32)
    nan = bool(np.isnan(out).any() or np.isnan(lse).any())
    diff = np.abs(out - ref_out)
    ref_max = float(np.abs(ref_out).max()) if ref_out.size else 0.0
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    worst = float(np.nanmax(diff / (atol + rtol * np.abs(ref_out)))) if diff.size else 0.0
    empty = np.isneginf(ref_lse)
    empty_ok = bool(np.array_equal(empty, np.isneginf(lse))
                    and not np.any(out[empty] != 0.0))
    finite = ~empty & np.isfinite(lse)
    lse_err = float(np.abs(lse[finite] - ref_lse[finite]).max()) if finite.any() else 0.0
    if not np.isfinite(lse[~empty]).all():
        lse_err = float("inf")
    ok = (not nan) and empty_ok and worst <= 1.0 and lse_err <= lse_atol
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / ref_max if ref_max else max_abs,
            "worst_ratio": worst, "lse_max_abs_err": lse_err, "nan": nan,
            "empty_rows": int(empty.sum()), "empty_rows_ok": empty_ok,
            "tolerance": {"atol": atol, "rtol": rtol, "lse_atol": lse_atol}, "pass": bool(ok)}


def run(cfg, deadline, part_end, record, results) -> None:
    """Runs every case while the part's budget lasts; fills `record` (see gpu_check.run_part)."""
    kernel = jax.jit(lambda *a: flash_attention(*a, interpret=cfg.interpret))
    reference = jax.jit(attention_reference)
    cases = kernel_cases(cfg.kernel_len, cfg.kernel_heads, cfg.dtype, cfg.seed)
    record.update(dtype=cfg.dtype, interpret=cfg.interpret, tolerance=TOLERANCES[cfg.dtype],
                  cases=[])
    for i, case in enumerate(cases):
        if deadline.left(part_end) < 5.0:
            record["skipped"] = [c["name"] for c in cases[i:]]
            print(f"   budget: skipping {record['skipped']}", flush=True)
            break
        args = (case["q"], case["k"], case["v"], case["q_positions"], case["kv_positions"])
        row = {"name": case["name"], "what": case["what"], "q_shape": list(case["q"].shape),
               "kv_shape": list(case["k"].shape)}
        record["cases"].append(row)
        start = time.monotonic()
        try:
            out, lse = jax.block_until_ready(kernel(*args))
            ref_out, ref_lse = reference(*args)
            row.update(check_tolerance(out, lse, ref_out, ref_lse, cfg.dtype))
        except KeyboardInterrupt:
            row.update({"pass": False, "interrupted": True})
            raise
        except Exception as err:  # noqa: BLE001 - a failing case is a result, not the end
            row.update({"pass": False, "error": f"{type(err).__name__}: {err}"})
        row["seconds"] = time.monotonic() - start
        print(f"   {row['name']:<14} max_abs={row.get('max_abs_err', float('nan')):.3g} "
              f"max_rel={row.get('max_rel_err', float('nan')):.3g} "
              f"{'PASS' if row['pass'] else 'FAIL'} ({row['seconds']:.1f} s)", flush=True)
        results.save()
    record["pass"] = bool(record["cases"]) and all(r["pass"] for r in record["cases"]) \
        and not record.get("skipped")
