"""`pallas_kernels.tune`: the sweep's FLOP count, rows and budget, in interpret mode on a CPU."""

import time

import numpy as np

from pallas_kernels import tune
from pallas_kernels.bench import causal_pairs
from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.reference import attention_reference

HEADS = (4, 2, 32)


def test_sweep_counts_pairs_like_bench_and_times_each_tiling():
    grid = [BlockSizes(block_q=64, block_k=32), BlockSizes(block_q=32, block_k=64)]
    case = tune.sweep_case("prefix 64+128", 64, 128, HEADS, grid, time.monotonic() + 600,
                           interpret=True, iters=1, warmup=0)
    q, k, v, q_pos, kv_pos, _ = tune.make_case(64, 128, HEADS, seed=192)
    assert q.shape == (1, 64, 4, 32) and k.shape == (1, 192, 2, 32)
    pairs = causal_pairs(np.asarray(q_pos), np.asarray(kv_pos))  # bench's independent count
    assert pairs == 64 * 128 + 64 * 65 // 2
    assert case["flops"] == 4 * 4 * 32 * pairs
    assert [(r["block_q"], r["block_k"]) for r in case["rows"]] == [(64, 32), (32, 64)]
    for row in case["rows"]:
        assert row["ms"] > 0 and np.isclose(row["tflops"], case["flops"] / row["ms"] / 1e9)
    assert case["cudnn_ms"] is None and "cuDNN" in case["cudnn_error"]  # no GPU here
    # The case's inputs are what the kernel is timed on: the reference attends them causally.
    out, _ = attention_reference(q, k, v, q_pos, kv_pos)
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_spent_budget_skips_every_tiling():
    grid = [BlockSizes(block_q=32, block_k=32)]
    case = tune.sweep_case("causal 64", 64, 0, HEADS, grid, time.monotonic() - 1,
                           interpret=True, iters=1, warmup=0)
    assert case["rows"] == [{"block_q": 32, "block_k": 32, "num_warps": None, "num_stages": 2,
                             "skipped": "budget spent"}]
