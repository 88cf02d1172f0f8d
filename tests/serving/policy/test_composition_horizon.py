"""The what-if controller's horizon rule (eval/RESULTS.md item 13): a change the window picks
must not lose to staying on the arrivals of the last `reverse_after_s`, the time it stands."""

from __future__ import annotations

import types

import numpy as np
import pytest

from eval.sim.simulator import simulate
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.composition_horizon import HorizonReplay
from serving.policy.cost_router import VertumnusRouter
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import WorkerState, layout_workers
from tests.serving.policy.test_composition import COST, SIM, poisson


def _horizon_case(length, gap, n):
    """A controller that saw `n` prompts of `length` tokens, one every `gap` s from 0 s."""
    ctl = CompositionController(CompositionConfig(min_degree=4, max_degree=8), lambda c: 100_000)
    for i in range(n):
        blocks = chain_block_hashes([i * 100 + k for k in range(-(-length // 512))])
        ctl.observe(Request(f"r{i}", gap * i, length, 1, blocks, 512), 0, gap * i)
    return ctl


def test_a_change_must_not_lose_on_the_horizon_it_stands_for():
    # A change stands `reverse_after_s` (600 s; a split is undone sooner only toward a better
    # target: test_composition_undo.py), so besides the window it
    # is weighed on the last 600 s of arrivals, replayed from idle workers. [8, 8] after 30K-
    # token prompts every 0.5 s: the two CP-8 take turns (T8 = 0.77 s < 1 s apart), no prompt
    # waits, staying's mean TTFT is T8 exactly. Split one: the one CP-8 left is busy when the
    # next prompt comes (0.5 s < T8), which waits or runs on CP-4 (T4 = 1.49 s): the split
    # loses and is refused.
    t8, t4 = COST.predict(8, 30_000, 0), COST.predict(4, 30_000, 0)
    assert 0.5 < t8 < 1.0 < t4
    active = [WorkerState(s) for s in layout_workers([8, 8], 10_000, 100_000)]
    sched = types.SimpleNamespace(cost_model=COST)
    ctl = _horizon_case(30_000, 0.5, 1200)  # arrivals at 0 .. 599.5 s
    figures = []
    # (the arrival at 0 s is out: the horizon is 0.5 .. 599.5 s, 599.5 s before 600)
    span = ctl._loses_on_horizon(sched, active, active[:1], [4, 4], 600.0, 120, figures)
    assert span == "the last 1199 arrivals (600 s)"
    (label, stay), (_, split) = figures
    assert label == "stay, the last 1199 arrivals (600 s) from idle workers"
    assert stay == pytest.approx(t8, rel=1e-12) and split > 1.05 * t8, figures
    # the horizon holds no more than the window's 1,199 arrivals: nothing more to weigh
    assert ctl._loses_on_horizon(sched, active, active[:1], [4, 4], 600.0, 1199, []) is None
    # a change as fast as staying (the same composition) does not lose: a tie stands
    assert ctl._loses_on_horizon(sched, active, [], [], 600.0, 120, []) is None
    # 2,000-token prompts at 100 a second, more than [8, 8] serves (2 / T8 = 63 a second) and
    # than [4, 4, 8] does (2 / T4 + 1 / T8 = 72): both queue, the split less, and it is kept
    t8, t4 = COST.predict(8, 2000, 0), COST.predict(4, 2000, 0)
    assert 2 / t8 < 2 / t4 + 1 / t8 < 100
    ctl, figures = _horizon_case(2000, 0.01, 1600), []
    assert ctl._loses_on_horizon(sched, active, active[:1], [4, 4], 16.0, 400, figures) is None
    assert figures[1][1] < figures[0][1], figures


def test_a_change_holding_more_of_the_horizon_does_not_lose_on_it():
    # Prompts of 12K tokens among 500-token ones on [4, 4] whose workers hold 8K: staying
    # holds none of the long ones, and its mean TTFT is over the short ones only (lower than
    # the merge's, which holds them all). Holding more comes first: the merge does not lose;
    # the reverse (the split of the CP-8 back into two CP-4) does.
    cap = {4: 8000, 8: 16_000}
    ctl = CompositionController(CompositionConfig(min_degree=4, max_degree=8), cap.get)
    for i in range(600):
        n = 12_000 if i % 10 == 0 else 500
        ctl.observe(Request(f"r{i}", 0.5 * i, n, 1, chain_block_hashes(
            [i * 100 + k for k in range(-(-n // 512))]), 512), 0, 0.5 * i)
    sched = types.SimpleNamespace(cost_model=COST)
    four = [WorkerState(s) for s in layout_workers([4, 4], 10_000, 8000)]
    figures = []
    assert ctl._loses_on_horizon(sched, four, four, [8], 300.0, 100, figures) is None
    (_, stay), (_, merged) = figures
    assert merged > stay, figures  # (the means are over different requests)
    eight = [WorkerState(s) for s in layout_workers([8], 10_000, 16_000)]
    assert ctl._loses_on_horizon(sched, eight, eight, [4, 4], 300.0, 100, []) is not None


def test_the_horizon_is_bounded_and_kept_in_time_order():
    # At most 4 x max_samples arrivals are kept; a placement time earlier than the last one
    # recorded is taken at the last one's (the window and the horizon stay sorted).
    ctl = CompositionController(CompositionConfig(max_samples=5), lambda c: 100_000)
    times = [float(t) for t in range(30)]
    times[25] = 3.0  # out of order
    for i, t in enumerate(times):
        ctl.observe(Request(f"r{i}", t, 1000, 1, chain_block_hashes([i, i + 1]), 512), 0, t)
    assert [t for t, _, _ in ctl._horizon] == [10.0 + k for k in range(15)] + [24.0] + [
        26.0 + k for k in range(4)]
    assert len(ctl._samples) == 20 and ctl._samples[15][0] == 24.0


def test_a_change_refused_on_the_horizon_leaves_the_controller_as_it_was():
    # [8, 8] after 30K-token prompts every 0.5 s for 540 s, then 16K-token ones at 8 a
    # second: on the last 60 s splitting a CP-8 pays (toward eight CP-2), on the 600 s the
    # change would stand it loses. Refused, logged with both figures; no change under way.
    # (The cost model without its floor, whose figures this case was built on: with it the
    # window's best step is 1 % short of the margin.)
    from serving.policy.cost_model import PrefillCostModel
    from serving.policy.profiles import generate_profile
    from serving.policy.scheduler import Scheduler
    from tests.serving.policy.test_membership import Backend
    plain = PrefillCostModel.fit(generate_profile("h20", "qwen3-30b-a3b", (1, 2, 4, 8)),
                                 floor=False)
    s = Scheduler(layout_workers([8, 8], 10_000, 100_000), plain, VertumnusRouter(), Backend())
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    ctl.attach(s)
    s.tick(0.0)
    arrivals = [(0.5 * i, 30_000) for i in range(1080)] + [
        (540.0 + i / 8, 16_000) for i in range(480)]
    for i, (t, n) in enumerate(arrivals):
        ctl.observe(Request(f"r{i}", t, n, 1, chain_block_hashes(
            [i * 100 + k for k in range(-(-n // 512))]), 512), 0, t)
    ctl._next_eval = 600.0
    s.tick(600.0)
    d = ctl.decisions[-1]
    assert "kind" not in d and not s.reconfig.in_progress and s.epoch == 0, d
    assert ctl._last == (None, -float("inf")) and ctl._quiet_until == 0.0
    figures = dict(d["candidates"])
    stay = figures["stay, the last 1559 arrivals (600 s) from idle workers"]
    change = figures["the change, the same arrivals"]
    assert change > stay, figures
    assert d["reason"] == ("split [0] beats staying by the margin on the window but not on "
                           "the last 1559 arrivals (600 s)")


def test_a_change_refused_on_the_horizon_is_logged_and_the_overload_rule_is_exempt(
        monkeypatch):
    # Every change is taken as losing on the horizon: the merge of the test above (long prompts
    # on [2, 2]) is not made, and the log says why; the overload rule's splits (90 req/s on
    # [8, 8]) are made all the same (an overloaded pool's queues grow whatever came before).
    monkeypatch.setattr(CompositionController, "_loses_on_horizon",
                        lambda *a: "the last 5 arrivals (9 s)")
    reqs = [Request(f"r{i}", t, 20_000, 1, chain_block_hashes([i * 100 + k for k in range(40)]),
                    512) for i, t in enumerate(poisson(120, 0.4, 3))]
    cfg = CompositionConfig(interval_s=10.0, cooldown_s=10.0, min_degree=2, max_degree=4)
    ctl = CompositionController(cfg, lambda c: 100_000)
    simulate(reqs, layout_workers([2, 2], 10_000, 100_000), COST, VertumnusRouter(), COST.predict,
             SIM, setup=[ctl.attach])
    assert not [d for d in ctl.decisions if d.get("kind")]
    refused = [d for d in ctl.decisions if "on the window but" in d["reason"]]
    assert refused and refused[0]["reason"] == (
        "merge [0, 1] beats staying by the margin on the window but not on the last 5 "
        "arrivals (9 s)"), ctl.decisions[:3]
    times = poisson(2700, 90.0, 2)
    lens = np.random.default_rng(1).integers(1000, 3000, len(times)).tolist()
    reqs = [Request(f"r{i}", t, n, 1, chain_block_hashes([i * 10 + k for k in range(-(-n // 512))]),
                    512) for i, (t, n) in enumerate(zip(times, lens))]
    ctl = CompositionController(CompositionConfig(interval_s=5.0, cooldown_s=5.0, min_degree=1,
                                                  max_degree=8), lambda c: 100_000)
    simulate(reqs, layout_workers([8, 8], 10_000, 100_000), COST, VertumnusRouter(), COST.predict,
             SIM, setup=[ctl.attach])
    assert ctl.decisions[0].get("kind") == "split", ctl.decisions[0]


def test_a_horizon_replay_loses_by_what_it_holds_then_by_its_mean():
    # Hand-computed: holding fewer arrivals loses whatever the means; holding as many, a higher
    # mean TTFT loses and a tie does not.
    assert HorizonReplay(1000, 20.0, 0.3, 0.5, 0, 0).loses()
    assert HorizonReplay(1000, 20.0, 0.3, 0.2, 0, 1).loses()
    assert not HorizonReplay(1000, 20.0, 0.2, 0.3, 1, 0).loses()
    assert not HorizonReplay(1000, 20.0, 0.3, 0.3, 0, 0).loses()
    assert HorizonReplay(1000, 20.4, 0.3, 0.3, 0, 0).span == "the last 1000 arrivals (20 s)"
