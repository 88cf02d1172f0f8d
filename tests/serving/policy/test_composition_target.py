"""The full comparison of the default controller (`serving.policy.composition_rules`): every
composition compared with the current one on equal terms (`target_of`); toward one better by
the margin, a step gaining a fifth of it, or, where no single step gains, the splits that make
it at once (`composition_changes.target_splits`)."""

from __future__ import annotations

import numpy as np
import pytest

import serving.policy.composition_changes as composition_changes
import serving.policy.composition_rules as composition_rules
from eval.sim.simulator import simulate
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.cost_router import VertumnusRouter
from serving.policy.whatif import Window
from serving.policy.worker import WorkerState, layout_workers
from tests.serving.policy.test_composition import COST, SIM, short_prompts


def run_70(monkeypatch=None, target=None, splits=True):
    """1-3K-token prompts at 70 req/s for 40 s on [8, 8] (a load of about 1.1: under the
    overload rule's margin); returns the controller and the mean TTFT (s)."""
    if target is not None:
        monkeypatch.setattr(composition_rules, "target_of", target)
    if not splits:
        monkeypatch.setattr(composition_rules, "target_splits", lambda *a: None)
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    recs = simulate(short_prompts(2800, 70.0), layout_workers([8, 8], 10_000, 100_000), COST,
                    VertumnusRouter(), COST.predict, SIM, setup=[ctl.attach])
    return ctl, np.mean([r.ttft for r in recs])


def test_the_splits_to_a_target_better_by_the_margin_are_made_at_once(monkeypatch):
    # At the first evaluation (early: the backlog outgrew the plan) no single split gains on
    # the window (its drain and re-carve cost more than one worker's halves serve by then),
    # but the comparison on equal terms finds sixteen CP-1 better by the margin: both CP-8 are
    # split into eight CP-1 in one evaluation, a change predicted better than staying by a
    # fifth of the margin. Split one worker at a time (the step toward the target, with no
    # splits at once), the pool waits for the load to reach the overload rule: over 3x the
    # mean TTFT.
    ctl, ttft = run_70()
    made = [d for d in ctl.decisions if d.get("kind")]
    first = made[0]
    assert first["kind"] == "split" and first["early"] and first["time"] < 10.0, made
    figures = dict(first["candidates"])
    label = first["chosen"]
    assert label == ("splits to the target: [0] into [1, 1, 1, 1, 1, 1, 1, 1], [1] into "
                     "[1, 1, 1, 1, 1, 1, 1, 1]"), first
    assert first["old"] == [0] and [f["old"] for f in first["further"]] == [[1]]
    assert len(first["new"]) == 8 and len(first["further"][0]["new"]) == 8
    cfg = CompositionConfig()
    assert figures[label] <= figures["stay"] * (1 - cfg.min_gain / 5)
    target = next(k for k in figures if k.startswith("target "))
    assert target == "target [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], beyond the backlog"
    assert figures[target] < figures["current, beyond the backlog"] * (1 - cfg.min_gain)
    # every single split was predicted worse than that fifth of the margin
    singles = [v for k, v in figures.items() if k.startswith("split [")]
    assert singles and min(singles) > figures["stay"] * (1 - cfg.min_gain / 5), figures
    # (made at a load above 1: the next evaluation comes when it is done)
    assert first["reason"].endswith("overloaded: next evaluation when done"), first
    _, ttft_steps = run_70(monkeypatch, splits=False)
    assert ttft < ttft_steps / 3, (ttft, ttft_steps)


def test_a_step_toward_a_target_better_by_the_margin(monkeypatch):
    # As above with no splits at once (`target_splits` finds none, as for a target that
    # needs a merge): at the regular evaluation (30 s) a split toward the target, itself no
    # worse than staying by a fifth of the margin, is made. With the target no better than
    # the current composition, nothing is made then.
    ctl, _ = run_70(monkeypatch, splits=False)
    made = next((d for d in ctl.decisions if d.get("kind")), None)
    assert made is not None and made["kind"] == "split", made
    labels = dict(made["candidates"])
    step = [label for label in labels if label.endswith("(toward the target)")]
    target = [label for label in labels if label.startswith("target ")]
    assert len(step) == 1 and len(target) == 1, made["candidates"]
    current = labels["current, beyond the backlog"]
    cfg = CompositionConfig()
    assert labels[target[0]] < current * (1 - cfg.min_gain)  # better by the margin
    assert labels[step[0]] <= labels["stay"] * (1 - cfg.min_gain / 5)  # the step gains a fifth
    real = composition_rules.target_of

    def no_better(active, *a):
        t, t_ttft, now_ttft, backlog = real(active, *a)
        return tuple(sorted(w.cp_degree for w in active)), now_ttft, now_ttft, backlog
    made_then, _ = run_70(monkeypatch, target=no_better, splits=False)
    made_then = next((d for d in made_then.decisions if d.get("kind")), None)
    assert made_then is None or made_then["time"] > made["time"], made_then


def workers(degrees, busy=()):
    """ACTIVE workers of `degrees` (ids in device order, largest degrees first); `busy`: worker
    id -> queued seconds."""
    ws = [WorkerState(s) for s in layout_workers(list(degrees), 10_000, 100_000)]
    for w in ws:
        w.queued_seconds = dict(busy).get(w.worker_id, 0.0)
    return ws


LENS = (1000, 2500, 6000)  # the window's prompts (tokens), none cached


def window():
    return Window.of([(0.1 * i, n, 0) for i, n in enumerate(LENS)], (1, 2, 4, 8), COST.predict)


def plan_of(ws, target, busy=()):
    free = {w.worker_id: dict(busy).get(w.worker_id, 0.0) for w in ws}
    got = composition_changes.target_splits(ws, target, 0.0, CompositionConfig(), free, window())
    return got if got is None else ([(w.worker_id, ps) for w, ps in got[0]], got[1], got[2])


def test_target_splits_plans_splits_only_and_keeps_the_busiest():
    cfg = CompositionConfig()
    # [8, 8] -> eight CP-2: each CP-8 into four CP-2, both starting after the re-carve
    plan, degrees, starts = plan_of(workers([8, 8]), [2] * 8)
    assert plan == [(0, [2, 2, 2, 2]), (1, [2, 2, 2, 2])]
    assert degrees == [2] * 8 and starts == [cfg.recarve_s] * 8
    # [8, 4, 4] (ids 0, 1, 2) -> one CP-4 and six CP-2: the CP-4 kept is the busier one
    # (worker 2, 3 s queued); worker 1's 2 s of queued CP-4 work is served by its two CP-2
    # parts, each at the window's sum T(4) / sum T(2) of a CP-4's speed
    busy = {2: 3.0, 1: 2.0}
    plan, degrees, starts = plan_of(workers([8, 4, 4], busy), [4] + [2] * 6, busy)
    assert plan == [(0, [2, 2, 2, 2]), (1, [2, 2])]
    assert degrees == [4] + [2] * 6
    speed = sum(COST.predict(4, n, 0) for n in LENS) / sum(COST.predict(2, n, 0) for n in LENS)
    assert 0.5 < speed < 1.0  # (a CP-2 is slower than a CP-4, faster than half of one)
    assert starts[:5] == [3.0] + [cfg.recarve_s] * 4
    assert starts[5:] == pytest.approx([cfg.recarve_s + 2.0 / (2 * speed)] * 2, rel=1e-12)
    # parts of several degrees, largest first (an aligned tiling)
    plan, degrees, _ = plan_of(workers([8, 8]), [4, 2, 2, 4, 2, 1, 1])
    assert plan == [(0, [4, 4]), (1, [2, 2, 2, 1, 1])] and degrees == [4, 4, 2, 2, 2, 1, 1]
    # a target needing a merge, or other GPUs, or the current composition: no splits
    assert plan_of(workers([4, 4]), [8]) is None
    assert plan_of(workers([4, 4]), [2, 2, 2]) is None
    assert plan_of(workers([4, 4]), [4, 4]) is None
    # [8, 2, 2] -> [4, 4, 2, 1, 1]: one CP-2 stays (the first, all idle), the other is split
    plan, degrees, _ = plan_of(workers([8, 2, 2]), [4, 4, 2, 1, 1])
    assert plan == [(0, [4, 4]), (2, [1, 1])] and degrees == [2, 4, 4, 1, 1]


def jumps(ctl):
    return [d for d in ctl.decisions if d["chosen"].startswith("splits to the target")]


def test_the_splits_to_the_target_wait_where_the_rules_say(monkeypatch):
    # The case above: the splits are made at a load above 1 even when every change loses on
    # the horizon (exempt, as the overload rule is: the queues grow whatever came before) ...
    # (the other gates, each alone: `test_jump_gates`)
    monkeypatch.setattr(composition_rules.CompositionRules, "_loses_on_horizon",
                        lambda *a: "the last 5 arrivals (9 s)")
    ctl, _ = run_70()
    assert jumps(ctl) and dict(jumps(ctl)[0]["candidates"])[
        "load (work / capacity) staying"] > 1.0
    monkeypatch.undo()
    # ... nor while the caches bind (a split costs context the replay cannot see) ...
    monkeypatch.setattr(composition_rules, "kv_pressure", lambda *a: 1.0)
    ctl, _ = run_70()
    assert not jumps(ctl) and not any(d.get("kind") == "split" for d in ctl.decisions)
    monkeypatch.undo()
    # ... nor where the window's requests found a cached prefix (one token each here)
    real = CompositionController.observe
    monkeypatch.setattr(CompositionController, "observe",
                        lambda self, r, cached, now: real(self, r, max(cached, 1), now))
    ctl, _ = run_70()
    assert not jumps(ctl) and any(k.startswith("target ") for d in ctl.decisions
                                  for k, _ in d["candidates"]), ctl.decisions[:3]


def test_change_start_spreads_or_retimes_the_queue():
    # One CP-8 with 1.2 s queued and 0.3 s of its running prefill left, split into two CP-4:
    # drain + re-carve + the queue spread over the parts as CP-8 seconds (single changes), or
    # served by them at a CP-4's speed, the window's sum T(8) / sum T(4) (the target's splits)
    cfg = CompositionConfig()
    [w] = workers([8], {0: 1.2})
    w.running, w.running_start, w.running_estimate = object(), 9.0, 0.5
    spread = composition_changes.change_start([w], [4, 4], 9.2, cfg)
    assert spread == pytest.approx(0.3 + cfg.recarve_s + 0.6, rel=1e-12)
    speed = sum(COST.predict(8, n, 0) for n in LENS) / sum(COST.predict(4, n, 0) for n in LENS)
    assert composition_changes.relative_speed(window(), 8, 4) == pytest.approx(speed, rel=1e-12)
    assert 0.5 < speed < 1.0
    timed = composition_changes.change_start([w], [4, 4], 9.2, cfg, window())
    assert timed == pytest.approx(0.3 + cfg.recarve_s + 1.2 / (2 * speed), rel=1e-12)
    # a degree against itself is 1; so is a pair no request of the window is held by
    assert composition_changes.relative_speed(window(), 4, 4) == 1.0
    held = Window.of([(0.0, 6000, 0)], (1, 2), COST.predict, {1: 5000, 2: 100_000}.get)
    assert composition_changes.relative_speed(held, 2, 1) == 1.0


def test_jump_gates(monkeypatch):
    # `_jump` on [8, 8] toward eight CP-2 (1 s of work queued on worker 1), its replay and
    # horizon stubbed: each gate alone refuses the splits the others would make.
    from serving.policy.scheduler import Scheduler
    from tests.serving.policy.scheduler_fixtures import Backend
    sched = Scheduler(layout_workers([8, 8], 10_000, 100_000), COST, VertumnusRouter(), Backend())
    active = list(sched.workers.values())
    active[1].queued_seconds = 1.0
    free = {w.worker_id: w.outstanding_seconds(0.0) for w in active}
    predicted, horizon = [(0.5, 0)], [None]
    monkeypatch.setattr(composition_rules, "replay_ttft", lambda *a: predicted[0])
    monkeypatch.setattr(composition_rules.CompositionRules, "_loses_on_horizon",
                        lambda *a: horizon[0])

    def jump(cfg=CompositionConfig(min_degree=1, max_degree=8), load=1.1, last=None,
             longest=0, cap=lambda c: 100_000):
        ctl = CompositionController(cfg, cap, longest)
        ctl._last = last or ctl._last
        figures = [("stay", 1.0)]
        ops, figures, urgent = ctl._jump(sched, active, [2] * 8, 0.0, 1.0, free, window(),
                                         figures, load, load, None, 100)
        return ops, figures, urgent, ctl

    ops, figures, urgent, _ = jump()
    assert [(k, old, [s.cp_degree for s in new]) for k, old, new in ops] == [
        ("split", [0], [2, 2, 2, 2]), ("split", [1], [2, 2, 2, 2])]
    assert figures[1] == ("splits to the target: [0] into [2, 2, 2, 2], [1] into [2, 2, 2, 2]",
                          0.5)
    assert urgent  # (load 1.1, eight CP-2 below it: goes on as the overload rule's)
    assert jump(load=0.9)[2] is False  # made at a load of at most 1: not urgent
    # the replay's gain short of a fifth of the margin (0.95 of staying's 1.0), or a request
    # the splits' workers cannot hold
    predicted[0] = (0.96, 0)
    assert jump()[0] is None
    predicted[0] = (0.5, 1)
    assert jump()[0] is None
    predicted[0] = (0.5, 0)
    # losing on the horizon: a veto at a load of at most 1, not above it
    horizon[0] = "the last 5 arrivals (9 s)"
    ops, _, _, ctl = jump(load=0.9)
    assert ops is None and ctl._vetoed.endswith("not on the last 5 arrivals (9 s)")
    assert jump(load=1.1)[0] is not None
    horizon[0] = None
    # within `reverse_after_s` of a merge; not after it
    cfg = CompositionConfig(min_degree=1, max_degree=8)
    assert jump(last=("merge", -cfg.reverse_after_s + 1.0))[0] is None
    assert jump(last=("merge", -cfg.reverse_after_s - 1.0))[0] is not None
    # halves only (`deep_splits=False`): four CP-2 from a CP-8 is not a halving
    assert jump(CompositionConfig(min_degree=1, max_degree=8, deep_splits=False))[0] is None
    # the only workers able to hold `longest` (CP-8 here: 6,000 tokens a GPU) are kept
    per_gpu = {c: 6000 * c for c in (1, 2, 4, 8)}.get
    assert jump(longest=40_000, cap=per_gpu)[0] is None
    assert jump(longest=10_000, cap=per_gpu)[0] is not None
