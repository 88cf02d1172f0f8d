"""The default controller's early evaluation (`CompositionController.tick`; issue 15's overload
case): before a plan, once the pool's backlog outgrows the plan, and what keeps the schedule."""

from __future__ import annotations

import pytest

import serving.policy.composition_rules as composition_rules
from eval.sim.simulator import simulate
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.cost_router import VertumnusRouter
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import layout_workers
from tests.serving.policy.test_composition import COST, SIM, refuse_once, short_prompts


def test_overload_from_the_start_splits_within_seconds_with_the_default_knobs():
    # The case from a cold start with the default knobs (evaluations every 30 s): the
    # backlog is beyond the plan from the first tick (there is no plan before the first
    # evaluation), so the overload is evaluated early and the first split comes within seconds,
    # not at the first regular evaluation 30 s in (when the backlog is about 0.4 x 30 s).
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    simulate(short_prompts(1800, 90.0), layout_workers([8, 8], 10_000, 100_000), COST,
             VertumnusRouter(), COST.predict, SIM, setup=[ctl.attach])
    first = next(d for d in ctl.decisions if d.get("kind"))
    assert first["kind"] == "split" and first["early"] and first["time"] < 10.0, ctl.decisions[:3]
    assert dict(first["candidates"])["load (work / capacity) staying"] > 1.25, first


def test_a_refused_first_split_leaves_the_early_check_armed():
    # As above, the scheduler refusing the first split (requests waiting would fit no worker
    # after it): no plan was made, so the next tick evaluates early again and splits, instead
    # of waiting for the regular evaluation at 31 s.
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    simulate(short_prompts(1800, 90.0), layout_workers([8, 8], 10_000, 100_000), COST,
             VertumnusRouter(), COST.predict, SIM, setup=[ctl.attach, refuse_once])
    refused = next(d for d in ctl.decisions if d.get("reason", "").startswith("not made"))
    split = next(d for d in ctl.decisions if d.get("kind") == "split")
    assert refused["early"] and refused["time"] < 10.0, refused
    assert split["early"] and split["time"] <= refused["time"] + 2 * SIM.tick_interval, split


def test_before_a_plan_only_arrivals_within_the_window_count():
    # `window_s` of 2 s at 90 req/s holds about 180 arrivals, fewer than `max_samples` (400):
    # the window is never full, so the first evaluation is the regular one, 30 s in.
    ctl = CompositionController(CompositionConfig(window_s=2.0, min_degree=1, max_degree=8),
                                lambda c: 100_000)
    simulate(short_prompts(3600, 90.0), layout_workers([8, 8], 10_000, 100_000), COST,
             VertumnusRouter(), COST.predict, SIM, setup=[ctl.attach])
    assert not ctl.decisions[0]["early"] and ctl.decisions[0]["time"] >= 30.0, ctl.decisions[0]


def test_an_idle_pool_is_not_evaluated_early():
    # No backlog, no early evaluation: a trickle of short prompts on [8, 8] is evaluated at the
    # regular times only (30 s apart from the first tick).
    reqs = [Request(f"r{i}", 3.0 * i, 1000, 1, chain_block_hashes([i * 10, i * 10 + 1]), 512)
            for i in range(40)]
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    simulate(reqs, layout_workers([8, 8], 10_000, 100_000), COST, VertumnusRouter(), COST.predict,
             SIM, setup=[ctl.attach])
    assert ctl.decisions and not any(d["early"] for d in ctl.decisions), ctl.decisions[:3]
    times = [d["time"] for d in ctl.decisions]
    assert all(b - a == pytest.approx(30.0, abs=1.01) for a, b in zip(times, times[1:])), times


def long_then_short(rate, n):
    """The load-shift case on [8, 8]: twenty 20K-token prompts 2 s apart, then from 40 s `n`
    2K-token prompts at `rate` req/s (two CP-8 workers serve about 63 a second); and a
    controller of degrees 1-8 for them."""
    long = [Request(f"l{i}", 2.0 * i, 20_000, 1, chain_block_hashes([i * 100 + k for k in
                                                                     range(40)]), 512)
            for i in range(20)]
    short = [Request(f"s{i}", 40.0 + i / rate, 2000, 1,
                     chain_block_hashes([10**6 + i * 10 + k for k in range(4)]), 512)
             for i in range(n)]
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    return long + short, ctl


def test_a_backlog_beyond_the_plan_brings_the_next_evaluation_forward():
    # [8, 8]; 20K-token prompts at 0.5 req/s (the evaluation at 30 s keeps the pool), then from
    # 40 s 2K-token prompts at 90 req/s, more than two CP-8 serve (63 a second). Once the
    # pool's backlog has grown by the mean TTFT the last evaluation predicted, the controller
    # evaluates at once instead of at 60 s, and splits.
    reqs, ctl = long_then_short(90, 1800)
    simulate(reqs, layout_workers([8, 8], 10_000, 100_000), COST, VertumnusRouter(),
             COST.predict, SIM, setup=[ctl.attach])
    first = ctl.decisions[0]
    assert first["time"] < 40.0 and first.get("kind") is None and not first["early"], first
    split = next(d for d in ctl.decisions if d.get("kind") == "split")
    assert split["early"] and 40.0 < split["time"] < 50.0, ctl.decisions[:3]


@pytest.mark.parametrize("rate, splits", [(75.0, True), (75.0, False), (80.0, True)])
def test_a_load_just_above_capacity_is_evaluated_in_full_when_the_backlog_outgrows_the_plan(
        rate, splits, monkeypatch):
    # as above, at 75 and 80 req/s: a load of 1.10 and 1.17, under the overload rule's 1.25.
    # The backlog outgrows the plan and the window's load above 1 explains it, so the full
    # comparison runs at once (before, only the overload rule could act early, and the pool
    # waited for the evaluation at 61 s). No single split gains then, but the splits to the
    # target, all at once, do (`test_composition_target`). Without them (`splits=False`), at
    # 75 req/s an early evaluation that changes nothing keeps the schedule: the split comes
    # at 61 s, not 30 s after the early one. A change made at a load above 1 goes on as the
    # overload rule's: the next evaluation comes when it is done, not after `cooldown_s`.
    if not splits:
        monkeypatch.setattr(composition_rules, "target_splits", lambda *a: None)
    reqs, ctl = long_then_short(rate, int(40 * rate))
    simulate(reqs, layout_workers([8, 8], 10_000, 100_000), COST, VertumnusRouter(),
             COST.predict, SIM, setup=[ctl.attach])
    early = [d for d in ctl.decisions if d["early"]]
    assert early and 40.0 < early[0]["time"] < 55.0, ctl.decisions[:4]
    load = dict(early[0]["candidates"])["load (work / capacity) staying"]
    assert 1.0 < load < 1.25, early[0]
    split = next(d for d in ctl.decisions if d.get("kind") == "split")
    if splits:
        assert split["early"] and split["time"] < 60.0, ctl.decisions[:4]
        assert split["reason"].endswith("overloaded: next evaluation when done"), split
        assert split["chosen"].startswith("splits to the target: "), split
        after = ctl.decisions[ctl.decisions.index(split) + 1]
        assert after["time"] < split["time"] + 5.0, ctl.decisions[:6]
    else:
        assert early[0].get("kind") is None and early[0]["reason"].endswith("no change pays")
        assert not split["early"] and split["time"] == 61.0, ctl.decisions[:4]


def test_an_early_change_refused_for_stranded_requests_keeps_the_schedule():
    # as above at 80 req/s, where an early evaluation splits (the splits to the target);
    # here the scheduler refuses the first split (requests waiting would fit no worker after
    # it): nothing changed, so the regular evaluation still comes at 61 s (before, the
    # refusal pushed it to 85 s)
    reqs, ctl = long_then_short(80, 3200)
    simulate(reqs, layout_workers([8, 8], 10_000, 100_000), COST, VertumnusRouter(),
             COST.predict, SIM, setup=[ctl.attach, refuse_once])
    i = next(k for k, d in enumerate(ctl.decisions) if d.get("reason", "").startswith("not made"))
    assert ctl.decisions[i]["early"] and 40.0 < ctl.decisions[i]["time"] < 60.0
    assert ctl.decisions[i + 1]["time"] == 61.0, ctl.decisions[i:i + 2]
