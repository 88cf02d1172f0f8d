"""Benchmark of `flash_attention` against `jax.nn.dot_product_attention` (XLA and cuDNN).

Usage:
  python -m pallas_kernels.bench                          # GPU: 4K/16K/32K/64K; CPU: 512 only
  python -m pallas_kernels.bench --sizes=16384 --output=/tmp/fa.json

Two cases per size N (bf16, batch 1, 32 query heads, 4 KV heads, head_dim 128 by default):
  causal:  N queries over N keys, positions 0..N-1 (plain causal prefill);
  prefix:  the last ~10% of N tokens (a multiple of 128) are new queries over the N keys, i.e. a
           cached prefix of N - n_new tokens (the baselines get the equivalent boolean mask).
Useful FLOPs are counted exactly from the positions: 4 * batch * heads * head_dim * (number of
(query, key) pairs with 0 <= key position <= query position). TFLOP/s of every implementation
uses that same count; `ratio_*` is kernel time / baseline time (< 1: the kernel is faster).
Prints a table and writes JSON (`--output`). An implementation that fails (e.g. XLA running out
of memory on the materialised logits, cuDNN absent on CPU) is reported with its error.
"""

from __future__ import annotations

import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.flash_attention import BlockSizes, flash_attention
from pallas_kernels.timing import median_ms

_SIZES = flags.DEFINE_list("sizes", None, "Total tokens N per case; default 4096,16384,32768,"
                           "65536 on GPU and 512 on CPU.")
_PREFIX_NEW = flags.DEFINE_float("prefix_new_fraction", 0.1, "New-token share of the prefix case.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_Q_HEADS = flags.DEFINE_integer("num_q_heads", 32, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 4, "KV heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dimension.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Dtype.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per implementation (median reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
_BLOCK_Q = flags.DEFINE_integer("block_q", 0, "Kernel block_q; 0 = backend default.")
_BLOCK_K = flags.DEFINE_integer("block_k", 0, "Kernel block_k; 0 = backend default.")
_NUM_WARPS = flags.DEFINE_integer("num_warps", 0, "Triton warps; 0 = heuristic.")
_NUM_STAGES = flags.DEFINE_integer("num_stages", 0, "Triton stages; 0 = backend default.")
_OUTPUT = flags.DEFINE_string("output", None, "JSON path; default "
                              "out/flash_attention_<backend>.json (GPU runs to keep: --output=pallas_kernels/results/...).")

_ROUND = 128  # new-token counts are multiples of this


def causal_pairs(q_positions: np.ndarray, kv_positions: np.ndarray) -> int:
    """Number of (query, key) pairs with 0 <= key position <= query position, over the batch."""
    total = 0
    for q_pos, kv_pos in zip(q_positions, kv_positions):
        keys = np.sort(kv_pos[kv_pos >= 0])
        total += int(np.searchsorted(keys, q_pos[q_pos >= 0], side="right").sum())
    return total


def _time_ms(fn, args, iters: int, warmup: int) -> float:
    """Median wall time of `fn(*args)` in milliseconds, after compilation and warm-up."""
    return median_ms(fn, args, iters, warmup)[1]


def _block_sizes(backend: str) -> BlockSizes:
    base = BlockSizes.get_default("cpu" if backend == "cpu" else "gpu")
    return BlockSizes(
        block_q=_BLOCK_Q.value or base.block_q,
        block_k=_BLOCK_K.value or base.block_k,
        num_warps=_NUM_WARPS.value or base.num_warps,
        num_stages=_NUM_STAGES.value or base.num_stages,
    )


def _case(name: str, n: int, rng: np.random.Generator, dtype):
    """One case's (q, k, v, q_positions, kv_positions, mask [1, 1, q_len, n] bool or None)."""
    if name == "causal":
        n_new = n
    else:
        n_new = max(_ROUND, int(round(n * _PREFIX_NEW.value / _ROUND)) * _ROUND)
    batch, heads, kv_heads, dim = _BATCH.value, _Q_HEADS.value, _KV_HEADS.value, _HEAD_DIM.value
    q = jnp.asarray(rng.standard_normal((batch, n_new, heads, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, n, kv_heads, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, n, kv_heads, dim)), dtype)
    q_pos = np.tile(np.arange(n - n_new, n, dtype=np.int32), (batch, 1))
    kv_pos = np.tile(np.arange(n, dtype=np.int32), (batch, 1))
    mask = None  # the causal case uses is_causal instead
    if name != "causal":
        mask = jnp.asarray(kv_pos[0][None, :] <= q_pos[0][:, None])[None, None]
    return q, k, v, jnp.asarray(q_pos), jnp.asarray(kv_pos), mask


def _run_case(name: str, n: int, blocks: BlockSizes) -> dict:
    dtype = jnp.dtype(_DTYPE.value)
    q, k, v, q_pos, kv_pos, mask = _case(name, n, np.random.default_rng(n), dtype)
    flops = 4 * _BATCH.value * _Q_HEADS.value * _HEAD_DIM.value * causal_pairs(
        np.asarray(q_pos), np.asarray(kv_pos))
    row = {"case": name, "tokens": n, "q_len": q.shape[1], "kv_len": k.shape[1], "flops": flops}

    kernel = jax.jit(lambda *a: flash_attention(*a, block_sizes=blocks)[0])
    impls = {"pallas": (kernel, (q, k, v, q_pos, kv_pos))}
    for impl in ("xla", "cudnn"):
        if name == "causal":
            fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=impl))
            impls[impl] = (fn, (q, k, v))
        else:  # bottom-right-aligned causal: jax.nn's is_causal is top-left aligned
            fn = jax.jit(lambda q, k, v, m, impl=impl: jax.nn.dot_product_attention(
                q, k, v, mask=m, implementation=impl))
            impls[impl] = (fn, (q, k, v, mask))

    outputs = {}
    for impl, (fn, args) in impls.items():
        try:
            ms = _time_ms(fn, args, _ITERS.value, _WARMUP.value)
            row[f"{impl}_ms"] = ms
            row[f"{impl}_tflops"] = flops / (ms * 1e-3) / 1e12
            if impl in ("pallas", "xla"):
                outputs[impl] = np.asarray(fn(*args), np.float32)
        except Exception as err:  # noqa: BLE001 - report any failure (OOM, unsupported) as n/a
            row[f"{impl}_ms"] = None
            row[f"{impl}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    for impl in ("xla", "cudnn"):
        if row["pallas_ms"] and row.get(f"{impl}_ms"):
            row[f"ratio_{impl}"] = row["pallas_ms"] / row[f"{impl}_ms"]
    if len(outputs) == 2:
        row["max_abs_err_vs_xla"] = float(np.abs(outputs["pallas"] - outputs["xla"]).max())
    return row


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _print_table(rows: list[dict]) -> None:
    header = (f"{'case':<7}{'N':>7}{'q_len':>7}  {'pallas ms':>10}{'TFLOP/s':>9}  "
              f"{'xla ms':>9}{'TFLOP/s':>9}{'ratio':>7}  {'cudnn ms':>9}{'TFLOP/s':>9}{'ratio':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['case']:<7}{r['tokens']:>7}{r['q_len']:>7}  "
              f"{_fmt(r.get('pallas_ms'), '.3f'):>10}{_fmt(r.get('pallas_tflops'), '.1f'):>9}  "
              f"{_fmt(r.get('xla_ms'), '.3f'):>9}{_fmt(r.get('xla_tflops'), '.1f'):>9}"
              f"{_fmt(r.get('ratio_xla'), '.2f'):>7}  "
              f"{_fmt(r.get('cudnn_ms'), '.3f'):>9}{_fmt(r.get('cudnn_tflops'), '.1f'):>9}"
              f"{_fmt(r.get('ratio_cudnn'), '.2f'):>7}")


def main(argv):
    del argv
    backend = jax.default_backend()
    default_sizes = ["512"] if backend == "cpu" else ["4096", "16384", "32768", "65536"]
    sizes = [int(s) for s in (_SIZES.value or default_sizes)]
    for s in sizes:
        if s < _ROUND:
            raise ValueError(f"--sizes entries must be >= {_ROUND} tokens, got {s}")
    blocks = _block_sizes(backend)
    rows = [_run_case(name, n, blocks) for n in sizes for name in ("causal", "prefix")]
    _print_table(rows)
    for r in rows:
        for key in ("pallas_error", "xla_error", "cudnn_error"):
            if key in r:
                print(f"  {r['case']} N={r['tokens']} {key}: {r[key]}")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": backend,
        "device_kind": jax.devices()[0].device_kind,
        "interpret": backend == "cpu",
        "dtype": _DTYPE.value,
        "batch": _BATCH.value,
        "num_q_heads": _Q_HEADS.value,
        "num_kv_heads": _KV_HEADS.value,
        "head_dim": _HEAD_DIM.value,
        "block_sizes": {"block_q": blocks.block_q, "block_k": blocks.block_k,
                        "num_warps": blocks.num_warps, "num_stages": blocks.num_stages},
        "iters": _ITERS.value,
        "rows": rows,
    }
    output = _OUTPUT.value or os.path.join("out", f"flash_attention_{backend}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {output}")


if __name__ == "__main__":
    app.run(main)
