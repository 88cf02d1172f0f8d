"""The simulated what-if choice of the default system's starting composition and router."""

from __future__ import annotations

import numpy as np
import pytest

from eval.whatif_sim import replay_choice
from serving.policy.cost_router import VertumnusRouter
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.worker import layout_workers


class Linear:
    """T = 10 ms + (L - h) ms / C: a prefill spends C x 10 ms of fixed GPU time."""

    def predict(self, c, n, h):
        return 0.01 + (n - h) * 1e-3 / c


def workers(comp):
    return layout_workers(list(comp), 1000, 100_000)


def test_choice_matches_separate_simulations_and_prefers_the_faster_option():
    # 200 distinct 2,000-token prompts at 1 req/s: one CP-4 worker serves one in 0.51 s (half
    # busy), two CP-2 workers in 1.01 s each, four CP-1 in 2.01 s: at this load the wait is
    # short everywhere and [4] wins; the scores are the simulations' mean TTFTs.
    t = np.cumsum(np.random.default_rng(0).exponential(1.0, 200)).tolist()
    sample = [Request(f"r{i}", x, 2000, 1, chain_block_hashes([i * 10 + k for k in range(4)]),
                      512) for i, x in enumerate(t)]
    comp, name, scores = replay_choice([[1, 1, 1, 1], [2, 2], [4]],
                                       {"cost": VertumnusRouter, "least": LeastWorkRouter},
                                       sample, workers, Linear())
    assert comp == [4] and set(scores) == {(c, r) for c in ((1, 1, 1, 1), (2, 2), (4,))
                                           for r in ("cost", "least")}
    assert all(failed == 0 for failed, _ in scores.values())
    best = min(v for _, v in scores.values())
    assert scores[((4,), name)][1] == best
    assert scores[((4,), "cost")][1] < scores[((2, 2), "cost")][1] < scores[((1, 1, 1, 1), "cost")][1]
    with pytest.raises(ValueError):
        replay_choice([], {"cost": VertumnusRouter}, sample, workers, Linear())


def test_replay_prices_evictions_at_the_reuse_share():
    # The replay starts from empty caches and is too short for contexts to be lost and asked
    # for again: a router with live sets gets one whose eviction cost uses the share of placed
    # blocks reused (here every prompt is placed twice on its worker: shares 0, 1, 0, 1, ...).
    made = []

    def make():
        made.append(VertumnusRouter(live_horizon_s=60.0))
        return made[-1]

    sample = [Request(f"r{i}", i * 0.5, 2000, 1, chain_block_hashes(
        [(i // 2) * 10 + k for k in range(4)]), 512) for i in range(20)]
    replay_choice([[4]], {"cost": make}, sample, workers, Linear())
    [router] = made
    assert router.live.rate == "reuse"
    assert router.live.size(0, 10.0) == 10 * 3  # 10 distinct prompts of 3 full blocks
    assert 0.3 < router.live.reuse_rate < 0.7
