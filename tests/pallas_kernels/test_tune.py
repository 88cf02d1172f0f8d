"""`pallas_kernels.tune`: the sweep's FLOP count, rows and budget, in interpret mode on a CPU."""

import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from pallas_kernels import timing, tune
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


def test_flags_are_checked_before_anything_runs():
    assert tune.cases_from_flags(["64"], ["16+32"]) == [("causal 64", 64, 0),
                                                        ("prefix 16+32", 16, 32)]
    bad = [((["64"], ["64+-8"]), "--prefix entries are NEW\\+CACHED"),
           (([], ["4096"]), "--prefix entries"), (([], ["0+16"]), "--prefix entries"),
           (([], []), "both empty"), ((["0"], []), "--causal takes one or more integers >= 1"),
           ((["x"], []), "--causal takes integers")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            tune.cases_from_flags(*args)
    assert tune.heads_from_flag(["32", "8", "128"]) == (32, 8, 128)
    for heads in (["32", "8"], ["3", "2", "16"], ["32", "0", "128"]):
        with pytest.raises(ValueError, match="--heads"):
            tune.heads_from_flag(heads)
    grid = tune.grid_from_flags(["64"], ["32", "64"], ["4"], ["2", "3"])
    assert [(b.block_k, b.num_stages) for b in grid] == [(32, 2), (32, 3), (64, 2), (64, 3)]
    with pytest.raises(ValueError, match="--block_q takes integers"):
        tune.grid_from_flags(["abc"], ["32"], ["4"], ["2"])
    with pytest.raises(ValueError, match="power of two"):
        tune.grid_from_flags(["48"], ["32"], ["4"], ["2"])
    with pytest.raises(ValueError, match="iters must be >= 1"):
        timing.median_ms(lambda: 0, (), iters=0, warmup=0)


def test_a_bad_flag_is_a_usage_error_before_any_timing(tmp_path):
    out = tmp_path / "t.json"
    run = subprocess.run([sys.executable, "-m", "pallas_kernels.tune", "--causal=",
                          "--prefix=4096", f"--output={out}"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "--prefix entries are NEW+CACHED" in run.stderr, run.stderr
    assert not out.exists() and "wrote" not in run.stdout
    # the defaults (16K tokens) on a CPU: refused, not hours of interpret mode
    if jax.default_backend() != "cpu":
        return  # (on a GPU the defaults run the sweep)
    run = subprocess.run([sys.executable, "-m", "pallas_kernels.tune", f"--output={out}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no GPU: in interpret mode cases above 1024" in run.stderr
    assert not out.exists()
