"""The what-if controller's overload rule once started (eval/RESULTS.md item 15): it goes on
while the load is above 1 even where the window predicts a step a little worse than staying."""

from __future__ import annotations

import numpy as np
import pytest

import serving.policy.composition as composition
from eval.sim.simulator import simulate
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.cost_router import VertumnusRouter
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import layout_workers
from tests.serving.policy.test_composition import COST, SIM, poisson


def _overload(n=2700):
    """1-3K-token prompts at 90 req/s: more than [8, 8] serves (issue 15's case)."""
    times = poisson(n, 90.0, 2)
    lens = np.random.default_rng(1).integers(1000, 3000, len(times)).tolist()
    return [Request(f"r{i}", t, m, 1, chain_block_hashes([i * 10 + k for k in range(-(-m // 512))]),
                    512) for i, (t, m) in enumerate(zip(times, lens))]


@pytest.mark.parametrize("worse_from_step", [1, 0])
def test_the_overload_rule_goes_on_where_the_window_shows_a_step_no_gain(monkeypatch,
                                                                        worse_from_step):
    # Every change is predicted 1 % worse than staying (the window holds a step's drain but
    # not the queue growth it stops), from the second step on or from the first. Started, the
    # rule goes on splitting while the load is above 1; it starts only on a step predicted no
    # worse than staying.
    ctl = CompositionController(CompositionConfig(interval_s=5.0, cooldown_s=5.0, min_degree=1,
                                                  max_degree=8), lambda c: 100_000)
    handle, stay = [], [0.0]
    real = composition.replay_ttft

    def replay(comp, window, lam, start):
        ttft, unheld = real(comp, window, lam, start)
        if sorted(comp) == sorted(handle[0].composition):
            stay[0] = ttft  # (staying is replayed first)
        elif sum(d.get("kind") == "split" for d in ctl.decisions) >= worse_from_step:
            ttft = max(ttft, 1.01 * stay[0])
        return ttft, unheld

    monkeypatch.setattr(composition, "replay_ttft", replay)
    simulate(_overload(), layout_workers([8, 8], 10_000, 100_000), COST, VertumnusRouter(),
             COST.predict, SIM, setup=[handle.append, ctl.attach])
    splits = [d for d in ctl.decisions if d.get("kind") == "split"]
    if worse_from_step == 0:
        assert not splits, splits[:1]
        assert dict(ctl.decisions[0]["candidates"])["load (work / capacity) staying"] > 1.25
        return
    assert len(splits) >= 3 and max(handle[0].composition) <= 4, handle[0].composition
    for d in splits[1:]:  # each later step: predicted worse than staying, made for the load
        figures = dict(d["candidates"])
        chosen = d["candidates"][1]
        assert chosen[1] > figures["stay"] and "(load " in chosen[0], d["candidates"]
        assert d["reason"].endswith("overloaded: next evaluation when done")
