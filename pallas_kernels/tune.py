"""Block-size sweep of `flash_attention` on one GPU: which `BlockSizes` is fastest per case.

Usage (on a GPU; `--dry_run` runs the same code at tiny shapes and a tiny grid; on a CPU every
run is in interpret mode, where the default 16K cases would take hours: there cases above
1,024 tokens are refused, use `--dry_run` or small `--causal` / `--prefix`):
  python -m pallas_kernels.tune --output=pallas_kernels/results/tune_h200.json
  python -m pallas_kernels.tune --dry_run --output=/tmp/tune.json

Cases (bf16, batch 1, Qwen3-8B heads: 32 query / 8 KV heads, head_dim 128 by default; the
gpu_check timing part's shapes): `causal N` (N queries over N keys) for each of `--causal`, and
`prefix n+h` (n new queries after h cached keys) for each of `--prefix`. Grid: every
(block_q, block_k, num_warps, num_stages) of the flags, in that order; a configuration Triton
refuses (shared memory, registers) is recorded with its error. Each configuration is timed as
`bench` times: median of `--iters` calls after compilation and `--warmup` calls, each in
`jax.block_until_ready`; TFLOP/s counts the visible (query, key) pairs exactly, as `bench`
does. cuDNN's `jax.nn.dot_product_attention` (`is_causal` for a causal case, the mask after a
cache, as `bench`) is timed once per case as the yardstick (`ratio` = kernel time / cuDNN
time). `--budget_s` is checked before every configuration: what is not started is recorded as
skipped (the configuration running then and each case's cuDNN call still finish). Rows record
the requested tiles; the kernel clips them to the padded sequence, so on short cases two rows
can run the same tiles. Prints a table per case (fastest first) and writes JSON after every
case. Flags are checked before anything runs (`cases_from_flags`, `heads_from_flag`,
`grid_from_flags`; a bad one is a usage error naming it).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.block_sizes import BlockSizes, default_num_warps
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.timing import median_ms

# Flags are defined only when run as a script (`_define_flags`), so importing this module next
# to `bench` (whose flags share names) defines nothing.
F = flags.FLAGS
# Without a GPU (interpret mode) longer cases are refused: the default 16K case ran for over 7
# minutes on one configuration of 36 on the 2-core VM.
_CPU_MAX_TOKENS = 1024


def make_case(new: int, cached: int, heads: tuple[int, int, int], seed: int):
    """(q, k, v, q_pos, kv_pos, mask): `new` bf16 queries after `cached` keys, causal.

    q: [1, new, hq, d]; k, v: [1, new + cached, hkv, d]; positions int32; mask [1, 1, new, n]
    bool (bottom-right-aligned causal, for `jax.nn.dot_product_attention`)."""
    hq, hkv, d = heads
    n = new + cached
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, new, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, n, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, n, hkv, d)), jnp.bfloat16)
    q_pos = np.arange(cached, n, dtype=np.int32)[None]
    kv_pos = np.arange(n, dtype=np.int32)[None]
    mask = jnp.asarray(kv_pos[0][None, :] <= q_pos[0][:, None])[None, None]
    return q, k, v, jnp.asarray(q_pos), jnp.asarray(kv_pos), mask


def sweep_case(name, new, cached, heads, grid, deadline, interpret, iters=10, warmup=2) -> dict:
    """Times cuDNN once and the kernel at every `BlockSizes` of `grid` until `deadline`
    (`time.monotonic()` seconds). Returns {case, new, cached, flops, cudnn_ms, rows}: one row per
    tiling, with `ms`, `tflops`, `ratio_cudnn`, or `error`, or `skipped`."""
    q, k, v, q_pos, kv_pos, mask = make_case(new, cached, heads, seed=new + cached)
    # Visible (query, key) pairs: query at position p sees keys 0..p (contiguous positions).
    pairs = sum(range(cached + 1, new + cached + 1))
    flops = 4 * heads[0] * heads[2] * pairs
    case = {"case": name, "new": new, "cached": cached, "flops": flops, "rows": []}
    try:  # plain causal: cuDNN's causal path; after a cache: the bottom-right mask
        if cached == 0:
            ref, ref_args = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn")), (q, k, v)
        else:
            ref, ref_args = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(
                q, k, v, mask=m, implementation="cudnn")), (q, k, v, mask)
        case["cudnn_ms"] = median_ms(ref, ref_args, iters, warmup)[1]
    except Exception as err:  # noqa: BLE001 - cuDNN absent (CPU) is a result, not a crash
        case["cudnn_ms"], case["cudnn_error"] = None, f"{type(err).__name__}: {str(err)[:200]}"
    for blocks in grid:
        row = {"block_q": blocks.block_q, "block_k": blocks.block_k,
               "num_warps": blocks.num_warps, "num_stages": blocks.num_stages}
        if time.monotonic() > deadline:
            case["rows"].append({**row, "skipped": "budget spent"})
            continue
        fn = jax.jit(lambda *a, b=blocks: flash_attention(
            *a, block_sizes=b, interpret=interpret)[0])
        try:
            row["first_ms"], row["ms"] = median_ms(
                fn, (q, k, v, q_pos, kv_pos), iters, warmup)
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            if case["cudnn_ms"]:
                row["ratio_cudnn"] = row["ms"] / case["cudnn_ms"]
        except Exception as err:  # noqa: BLE001 - Triton refusing a tiling is a result
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        case["rows"].append(row)
    return case


def print_case(case: dict, default: BlockSizes) -> None:
    """Prints one case's table, fastest configuration first; `*` marks the default tiles."""
    cudnn = case["cudnn_ms"]
    print(f"\n{case['case']}: cuDNN {'n/a' if cudnn is None else f'{cudnn:.3f} ms'}")
    print(f"  {'bq':>4}{'bk':>5}{'warps':>6}{'stages':>7}{'ms':>10}{'TFLOP/s':>9}{'ratio':>7}")
    timed = sorted((r for r in case["rows"] if "ms" in r), key=lambda r: r["ms"])
    for r in timed:
        mark = "*" if (r["block_q"], r["block_k"], r["num_stages"], r["num_warps"]) == (
            default.block_q, default.block_k, default.num_stages,
            default.num_warps or default_num_warps(default.block_q, default.block_k)) else " "
        ratio = f"{r['ratio_cudnn']:.2f}" if "ratio_cudnn" in r else "n/a"
        print(f" {mark}{r['block_q']:>4}{r['block_k']:>5}{r['num_warps']:>6}"
              f"{r['num_stages']:>7}{r['ms']:>10.3f}{r['tflops']:>9.1f}{ratio:>7}")
    failed = [r for r in case["rows"] if "error" in r]
    skipped = [r for r in case["rows"] if "skipped" in r]
    for r in failed:
        print(f"   failed {r['block_q']}x{r['block_k']} w{r['num_warps']} s{r['num_stages']}: "
              f"{r['error']}")
    if skipped:
        print(f"   {len(skipped)} configurations skipped (budget spent)")


def _ints(name: str, values, low: int = 1) -> list[int]:
    """`values` (a list flag's strings) as ints >= `low`; ValueError naming `--name` if not."""
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise ValueError(f"--{name} takes integers, got {','.join(values)!r}") from None
    if not out or min(out) < low:
        raise ValueError(f"--{name} takes one or more integers >= {low}, got {out}")
    return out


def cases_from_flags(causal, prefix) -> list[tuple[str, int, int]]:
    """(name, new, cached) per case of `--causal` (N >= 1) and `--prefix` (NEW+CACHED, NEW >= 1,
    CACHED >= 0). Raises ValueError naming the flag for a malformed entry or no case at all."""
    cases = [(f"causal {n}", n, 0) for n in (_ints("causal", causal) if causal else [])]
    for spec in prefix:
        parts = spec.split("+")
        try:
            new, cached = (int(x) for x in parts) if len(parts) == 2 else (0, -1)
        except ValueError:
            new, cached = 0, -1
        if new < 1 or cached < 0:
            raise ValueError(f"--prefix entries are NEW+CACHED with NEW >= 1 and CACHED >= 0, "
                             f"got {spec!r}")
        cases.append((f"prefix {new}+{cached}", new, cached))
    if not cases:
        raise ValueError("--causal and --prefix are both empty: no case to time")
    return cases


def heads_from_flag(values) -> tuple[int, int, int]:
    """`--heads` as (query heads, KV heads, head_dim): three integers >= 1, the query heads a
    multiple of the KV heads (GQA). Raises ValueError naming the flag otherwise."""
    heads = _ints("heads", values)
    if len(heads) != 3 or heads[0] % heads[1]:
        raise ValueError(f"--heads is QUERY_HEADS,KV_HEADS,HEAD_DIM with the query heads a "
                         f"multiple of the KV heads, got {heads}")
    return tuple(heads)


def grid_from_flags(block_q, block_k, num_warps, num_stages) -> list[BlockSizes]:
    """Every (block_q, block_k, num_warps, num_stages) of the four list flags, in that order.
    Raises ValueError naming the flag (or `BlockSizes`' own: a block size that is not a power
    of two >= 16, warps outside [1, 32])."""
    values = [_ints(name, v) for name, v in (("block_q", block_q), ("block_k", block_k),
                                              ("num_warps", num_warps),
                                              ("num_stages", num_stages))]
    return [BlockSizes(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
            for bq, bk, w, s in itertools.product(*values)]


def main(argv):
    del argv
    t0 = time.monotonic()
    interpret = jax.default_backend() == "cpu"
    try:
        if F.iters < 1 or F.warmup < 0:
            raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {F.iters}, "
                             f"{F.warmup}")
        if F.dry_run:
            cases = [("causal 256", 256, 0), ("prefix 128+256", 128, 256)]
            heads, grid = (4, 2, 64), grid_from_flags([64, 128], [64], [4], [2])
        else:
            cases = cases_from_flags(F.causal, F.prefix)
            if interpret and max(n + h for _, n, h in cases) > _CPU_MAX_TOKENS:
                raise ValueError(f"no GPU: in interpret mode cases above {_CPU_MAX_TOKENS} "
                                 f"tokens take hours; use --dry_run, or --causal / --prefix "
                                 f"of at most {_CPU_MAX_TOKENS} tokens on a CPU")
            heads = heads_from_flag(F.heads)
            grid = grid_from_flags(F.block_q, F.block_k, F.num_warps, F.num_stages)
    except ValueError as err:
        raise app.UsageError(str(err)) from None
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {len(grid)} configurations"
          f" x {len(cases)} cases, budget {F.budget_s:.0f} s", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax_version": jax.__version__, "device_kind": jax.devices()[0].device_kind,
              "interpret": interpret, "heads": heads, "dtype": "bfloat16",
              "iters": F.iters, "cases": []}
    os.makedirs(os.path.dirname(os.path.abspath(F.output)), exist_ok=True)
    deadline = t0 + F.budget_s
    for name, new, cached in cases:
        case = sweep_case(name, new, cached, heads, grid, deadline, interpret,
                          F.iters, F.warmup)
        result["cases"].append(case)
        print_case(case, BlockSizes.get_default("gpu"))
        with open(F.output + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(F.output + ".tmp", F.output)
    print(f"\nwrote {F.output} in {time.monotonic() - t0:.0f} s")


def _define_flags():
    flags.DEFINE_list("causal", ["16384", "4096"], "Causal cases: total tokens N.")
    flags.DEFINE_list("prefix", ["4096+28672"], "Prefix cases: new+cached tokens.")
    flags.DEFINE_list("block_q", ["64", "128"], "block_q values.")
    flags.DEFINE_list("block_k", ["32", "64", "128"], "block_k values.")
    flags.DEFINE_list("num_warps", ["4", "8"], "num_warps values.")
    flags.DEFINE_list("num_stages", ["2", "3", "4"], "num_stages values.")
    flags.DEFINE_list("heads", ["32", "8", "128"], "Query heads, KV heads, head_dim.")
    flags.DEFINE_integer("iters", 10, "Timed calls per configuration (median).")
    flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
    flags.DEFINE_float("budget_s", 240.0, "No configuration starts after this many s.")
    flags.DEFINE_boolean("dry_run", False, "Tiny shapes and grid (any backend; on a CPU every "
                         "run is in interpret mode).")
    flags.DEFINE_string("output", "out/tune_flash_attention.json", "JSON path.")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
