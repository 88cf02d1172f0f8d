"""Part "timing" of `python -m vertumnus_jax.gpu_check`: the kernel against jax.nn's attention.

Cases (batch 1, bf16, Qwen3-8B heads: 32 q / 8 kv, head_dim 128 on the GPU): causal prefill of
N tokens for N in `timing_causal` (4K, 16K, 32K), and `new` tokens after `cached` ones for
`timing_prefix` (4K after 28K). `jax.nn.dot_product_attention` gets `is_causal=True` for causal
prefill and, for the cached case, the boolean mask `key <= query` (its `is_causal` is aligned
top-left, so it cannot express queries that start after a prefix; cuDNN receives that mask as an
additive bias and computes the whole 4K x 32K rectangle).

FLOPs are counted honestly: `4 * head_dim * num_q_heads * (number of (query, key) pairs with
0 <= key position <= query position)` (QK^T and PV, 2 FLOPs per multiply-add each, only the
unmasked part), the same count for every implementation. Causal N: N (N + 1) / 2 pairs.

Each implementation is compiled first (`jit(...).lower(...).compile()`, timed apart), run once,
warmed up `timing_warmup` times and timed `timing_iters` times (`jax.block_until_ready` around
each call); the median is reported. A failing implementation (cuDNN absent, XLA out of memory on
its materialised logits) is recorded with its error and the others go on. `ratio` is the
kernel's time over the fastest reference's (<= 1: the kernel is at least as fast);
`max_abs_diff_vs_<impl>` compares the outputs (a sanity check that the timed code computes the
same thing; the kernel part checks accuracy).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.timing import call_seconds

REFERENCES = ("cudnn", "xla")


def causal_pairs(q_positions, kv_positions) -> int:
    """Number of (query, key) pairs with 0 <= key position <= query position, over the batch
    (negative positions are padding)."""
    total = 0
    for q_pos, kv_pos in zip(np.atleast_2d(q_positions), np.atleast_2d(kv_positions)):
        keys = np.sort(kv_pos[kv_pos >= 0])
        total += int(np.searchsorted(keys, q_pos[q_pos >= 0], side="right").sum())
    return total


def attention_flops(q_positions, kv_positions, num_q_heads: int, head_dim: int) -> int:
    """Useful forward FLOPs: 4 * head_dim * num_q_heads * causal_pairs (QK^T and PV)."""
    return 4 * int(head_dim) * int(num_q_heads) * causal_pairs(q_positions, kv_positions)


def time_fn(fn, args, iters: int, warmup: int) -> dict:
    """Compiles `jax.jit(fn)` for `args` (timed apart), then returns the median of `iters`
    timed calls after one run and `warmup` more: compile_s, ms, min_ms, and the output."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    out = jax.block_until_ready(compiled(*args))
    times = call_seconds(compiled, args, iters, warmup)
    return {"compile_s": compile_s, "ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times), "out": out}


def timing_cases(cfg) -> list[dict]:
    """The (name, new, cached) cases of `cfg`: causal first, then cached-prefix ones."""
    cases = [{"name": f"causal {n}", "new": n, "cached": 0} for n in cfg.timing_causal]
    cases += [{"name": f"{new} after {cached}", "new": new, "cached": cached}
              for new, cached in cfg.timing_prefix]
    return cases


def _inputs(case, heads, dtype, seed):
    hq, hkv, d = heads
    n, h = case["new"], case["cached"]
    key = jax.random.key(seed + n + h)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, n, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (1, n + h, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (1, n + h, hkv, d), jnp.float32).astype(dtype)
    q_pos = np.arange(h, h + n, dtype=np.int32)[None]
    kv_pos = np.arange(n + h, dtype=np.int32)[None]
    return q, k, v, q_pos, kv_pos


def _impl_fn(impl, case, interpret):
    """(function, extra args) of one implementation for one case."""
    if impl == "pallas":
        return (lambda q, k, v, qp, kp: flash_attention(q, k, v, qp, kp,
                                                        interpret=interpret)[0]), "positions"
    if case["cached"] == 0:
        return (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl)), None
    return (lambda q, k, v, m: jax.nn.dot_product_attention(
        q, k, v, mask=m, implementation=impl)), "mask"


def run_case(case, cfg, part_end, deadline, row: dict | None = None, save=None) -> dict:
    """Times every implementation of `cfg.timing_impls` on one case, filling `row` (a new dict
    by default) and calling `save()` after each implementation (a kill keeps what finished)."""
    row = {"impls": {}} if row is None else row
    row.update(case=case["name"], new=case["new"], cached=case["cached"])
    row.setdefault("impls", {})
    q, k, v, q_pos, kv_pos = _inputs(case, cfg.timing_heads, jnp.dtype(cfg.dtype), cfg.seed)
    flops = attention_flops(q_pos, kv_pos, cfg.timing_heads[0], cfg.timing_heads[2])
    row["flops"] = flops
    outputs = {}
    for impl in cfg.timing_impls:
        if deadline.left(part_end) < 3.0:
            row["impls"][impl] = {"error": "skipped: out of budget"}
            continue
        fn, extra = _impl_fn(impl, case, cfg.interpret)
        args = [q, k, v]
        if extra == "positions":
            args += [jnp.asarray(q_pos), jnp.asarray(kv_pos)]
        elif extra == "mask":
            args.append(jnp.asarray(kv_pos[0][None, :] <= q_pos[0][:, None])[None, None])
        try:
            t = time_fn(fn, args, cfg.timing_iters, cfg.timing_warmup)
            outputs[impl] = t.pop("out")
            t["tflops"] = flops / (t["ms"] * 1e-3) / 1e12
            row["impls"][impl] = t
        except Exception as err:  # noqa: BLE001 - a failing implementation is reported
            msg = f"{type(err).__name__}: {err}"
            row["impls"][impl] = {"error": msg[:2000]}
        if save is not None:
            save()
    refs = {r: row["impls"][r]["ms"] for r in REFERENCES if "ms" in row["impls"].get(r, {})}
    if refs and "ms" in row["impls"].get("pallas", {}):
        best = min(refs, key=refs.get)
        row["fastest_reference"] = best
        row["ratio"] = row["impls"]["pallas"]["ms"] / refs[best]
    if "pallas" in outputs:
        base = outputs["pallas"].astype(jnp.float32)
        for impl, out in outputs.items():
            if impl != "pallas":
                row[f"max_abs_diff_vs_{impl}"] = float(jnp.max(jnp.abs(base - out.astype(
                    jnp.float32))))
    return row


def _line(row) -> str:
    parts = []
    for impl, t in row["impls"].items():
        parts.append(f"{impl} {t['ms']:.3f} ms {t['tflops']:.1f} TF/s" if "ms" in t
                     else f"{impl} n/a")
    ratio = f"  ratio {row['ratio']:.2f}" if "ratio" in row else ""
    return f"   {row['case']:<14} " + " | ".join(parts) + ratio


def run(cfg, deadline, part_end, record, results) -> None:
    """Times every case while the part's budget lasts; fills `record`."""
    hq, hkv, d = cfg.timing_heads
    record.update(dtype=cfg.dtype, heads={"q": hq, "kv": hkv, "head_dim": d}, batch=1,
                  iters=cfg.timing_iters, warmup=cfg.timing_warmup, interpret=cfg.interpret,
                  cases=[])
    cases = timing_cases(cfg)
    for i, case in enumerate(cases):
        if deadline.left(part_end) < 5.0:
            record["skipped"] = [c["name"] for c in cases[i:]]
            print(f"   budget: skipping {record['skipped']}", flush=True)
            break
        start = time.monotonic()
        row = {"case": case["name"], "new": case["new"], "cached": case["cached"], "impls": {}}
        record["cases"].append(row)  # filled in place, saved after each implementation
        try:
            run_case(case, cfg, part_end, deadline, row, results.save)
        except KeyboardInterrupt:
            row["interrupted"] = True
            row["seconds"] = time.monotonic() - start
            raise
        except Exception as err:  # noqa: BLE001 - e.g. out of memory building the inputs
            row["error"] = f"{type(err).__name__}: {err}"[:2000]
        row["seconds"] = time.monotonic() - start
        print(_line(row), flush=True)
        results.save()
