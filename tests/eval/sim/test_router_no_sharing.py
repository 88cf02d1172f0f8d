"""With no prefix sharing, the placement-cost router is never worse than least-loaded routing
by more than noise (issue "The Vertumnus policies", behaviour that must hold)."""

from __future__ import annotations

import numpy as np
import pytest

from eval.experiment import ReplayConfig, run_sweep
from serving.policy.request import Request, chain_block_hashes, num_blocks


def no_sharing_workload(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0, n))
    lengths = np.clip(rng.lognormal(np.log(6000), 0.9, n), 64, 100_000).astype(int)
    return [Request(i, float(t[i]), int(L), 100,
                    chain_block_hashes(range(10**7 * (i + 1), 10**7 * (i + 1) + num_blocks(int(L), 512))),
                    512) for i, L in enumerate(lengths)]


@pytest.mark.parametrize("degree", [2, 4])
def test_cost_router_not_worse_than_least_loaded_without_sharing(degree):
    reqs = no_sharing_workload()
    cfg = ReplayConfig(num_gpus=16, degrees=(degree,), load_factors=(0.5, 0.8, 0.95),
                       systems=(f"homogeneous-cp{degree}", f"leastwork-cp{degree}"))
    results, _ = run_sweep(reqs, "nosharing", cfg)
    by = {(r["system"], r["load_factor"]): r for r in results}
    for f in cfg.load_factors:
        ours = by[(f"homogeneous-cp{degree}", f)]
        base = by[(f"leastwork-cp{degree}", f)]
        assert ours["prefix_hit_rate"] == 0 and base["prefix_hit_rate"] == 0
        assert ours["mean_ttft_ms"] <= 1.05 * base["mean_ttft_ms"]
        assert ours["p90_ttft_ms"] <= 1.05 * base["p90_ttft_ms"]
