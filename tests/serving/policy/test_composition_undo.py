"""The default controller gives back a split's capacity once the full comparison finds the
composition before it better (`serving.policy.composition_rules`): within `reverse_after_s` of
a split a merge is made only as a step toward that target, weighed on the arrivals of the last
`reverse_after_s`, the steps one after another, and the split's `reverse_after_s` still stands
(a split may follow)."""

from __future__ import annotations

from collections import deque

import numpy as np

import serving.policy.composition_rules as composition_rules
from eval.sim.simulator import simulate
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.cost_router import VertumnusRouter
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import layout_workers
from tests.serving.policy.test_composition import COST, SIM

# (seconds, req/s): light, a burst just above [8, 8]'s capacity (about 63 req/s), light again
PHASES = ((10.0, 32.0), (5.0, 73.6), (90.0, 41.6))


def burst_then_light(seed=2):
    """1-3K-token prompts (no shared prefix), Poisson at each phase's rate."""
    rng, out, t0 = np.random.default_rng(seed), [], 0.0
    for length, rate in PHASES:
        t = t0 + rng.exponential(1.0 / rate)
        while t < t0 + length:
            n, i = int(rng.integers(1000, 3000)), len(out)
            out.append(Request(f"r{i}", t, n, 1, chain_block_hashes(
                [i * 10 + k for k in range(-(-n // 512))]), 512))
            t += rng.exponential(1.0 / rate)
        t0 += length
    return out


def run(monkeypatch=None, merges_toward=True, target=None):
    """Runs `burst_then_light` on [8, 8]; returns the controller and the mean TTFT (s) of the
    arrivals after the first 45 s."""
    if not merges_toward:  # (as before: no merge within `reverse_after_s` of a split)
        real = composition_rules.moves_toward
        monkeypatch.setattr(composition_rules, "moves_toward", lambda cur, olds, news, tgt: (
            len(news) > len(olds) and real(cur, olds, news, tgt)))
    if target is not None:
        monkeypatch.setattr(composition_rules, "target_of", target)
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    recs = simulate(burst_then_light(), layout_workers([8, 8], 10_000, 100_000), COST,
                    VertumnusRouter(), COST.predict, SIM, setup=[ctl.attach])
    late = [r.ttft for r in recs if r.request.arrival_time >= 45.0]
    assert len(recs) == len(burst_then_light()) and all(r.ok for r in recs)
    return ctl, float(np.mean(late))


def test_a_burst_split_is_given_back_step_by_step_toward_the_target(monkeypatch):
    # The burst (a load just above 1 on [8, 8]) splits both CP-8 into CP-1 at once; in the
    # light phase after it the full comparison finds larger workers better by the margin, and
    # merges toward them follow one another (the next evaluation when each is done), long
    # before the split's `reverse_after_s` (600 s) would have allowed any merge.
    cfg = CompositionConfig()
    ctl, late = run()
    made = [d for d in ctl.decisions if d.get("kind")]
    split, merges = made[0], made[1:]
    assert split["kind"] == "split" and 10.0 <= split["time"] <= 20.0, made
    assert len(merges) >= 3 and all(d["kind"] == "merge" for d in merges), made
    assert merges[-1]["time"] < split["time"] + cfg.reverse_after_s
    assert merges[1]["time"] - merges[0]["time"] < cfg.cooldown_s  # (no cooldown between)
    for d in merges:
        figures = dict(d["candidates"])
        assert d["chosen"].endswith("(toward the target)"), d
        target = next(v for k, v in figures.items() if k.startswith("target "))
        assert target < figures["current, beyond the backlog"] * (1 - cfg.min_gain), d
        assert figures[d["chosen"]] <= figures["stay"] * (1 - cfg.min_gain / 5), d
    # each weighed, and not lost, on every arrival of the last `reverse_after_s` (logged as
    # "the last N arrivals (S s)": here all of them, the burst included)
    figures = dict(merges[0]["candidates"])
    [span] = [k for k in figures if k.startswith("stay, the last ")]
    since = float(span.split("(")[1].split(" s)")[0])
    assert merges[0]["time"] - 1.0 <= since <= merges[0]["time"]
    assert figures["the change, the same arrivals"] <= figures[span]
    # the split's `reverse_after_s` stands: the merges did not restart it, and a split is
    # again among the candidates after them
    assert ctl._last == ("split", split["time"])
    after = [d for d in ctl.decisions if d["time"] > merges[0]["time"]]
    assert any(k.startswith("split [") for d in after for k, _ in d["candidates"]), after[:3]
    # without the steps back the light phase is served by the burst's CP-1 workers
    _, late_kept = run(monkeypatch, merges_toward=False)
    assert late < 0.7 * late_kept, (late, late_kept)


def test_no_merge_within_reverse_after_s_of_a_split_but_toward_the_target(monkeypatch):
    # `_best` on four idle CP-4 (no change in progress), the replay stubbed: any composition
    # with a CP-8 predicted at half of staying's mean TTFT, so a merge beats staying by the
    # margin on the window alone; the horizon never vetoes.
    from serving.policy.scheduler import Scheduler
    from tests.serving.policy.scheduler_fixtures import Backend
    sched = Scheduler(layout_workers([4, 4, 4, 4], 10_000, 100_000), COST, VertumnusRouter(),
                      Backend())
    monkeypatch.setattr(composition_rules, "replay_ttft",
                        lambda comp, *a: (0.5 if 8 in comp else 1.0, 0))
    weighed = []  # the arrivals each change was weighed on, past the window
    monkeypatch.setattr(composition_rules.CompositionRules, "_loses_on_horizon",
                        lambda self, *a: weighed.append(a[-1]))
    targets = {"better": ((8, 8), 0.5, 1.0, 0.0), "none": ((4, 4, 4, 4), 1.0, 1.0, 0.0)}
    sample = [(0.1 * i, 1000 + 500 * (i % 4), 0) for i in range(40)]

    def best(last, target, sample=sample):
        monkeypatch.setattr(composition_rules, "target_of", lambda *a: targets[target])
        ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8),
                                    lambda c: 100_000)
        ctl._last = last
        ctl._since.extend([(t, 1500, 0) for t in (split_at - 1.0, split_at, 50.0)])
        ops, figures, urgent = ctl._best(sched, 100.0, sample, False, 4.0)
        return ops and [(k, old, [s.cp_degree for s in new]) for k, old, new in ops], \
            dict(figures), ctl._undoing

    cfg = CompositionConfig()
    split_at = 100.0 - cfg.reverse_after_s + 1.0
    # no split before: the merge the window prefers, better by the margin, is made (weighed
    # on the horizon rule's arrivals)
    ops, figures, undoing = best((None, -float("inf")), "none")
    assert ops == [("merge", [0, 1], [8])] and not undoing, figures
    assert figures["merge [0, 1]"] == 0.5 and figures["stay"] == 1.0
    assert isinstance(weighed[-1], deque) and not weighed[-1]  # (the horizon, empty here)
    # within `reverse_after_s` of a split, with nothing better in the full comparison: none
    assert best(("split", split_at), "none")[0] is None
    # ... with a target better by the margin, the same merge as a step toward it, undoing,
    # weighed on the arrivals kept of the last `reverse_after_s` (`_since`)
    ops, figures, undoing = best(("split", split_at), "better")
    assert ops == [("merge", [0, 1], [8])] and undoing
    assert figures["merge [0, 1] (toward the target)"] == 0.5
    assert list(weighed[-1]) == [(t, 1500, 0) for t in (split_at - 1.0, split_at, 50.0)]
    # ... nor one that leaves the load plus the backlog to clear above 1 (the overload rule
    # would split again at once)
    monkeypatch.setattr(composition_rules, "pool_load",
                        lambda comp, *a: 1.05 if 8 in comp else 0.8)
    assert best(("split", split_at), "better")[0] is None
    monkeypatch.setattr(composition_rules, "pool_load",
                        lambda comp, *a: 0.95 if 8 in comp else 0.8)
    assert best(("split", split_at), "better")[0] == [("merge", [0, 1], [8])]
    monkeypatch.undo()
    monkeypatch.setattr(composition_rules, "replay_ttft",
                        lambda comp, *a: (0.5 if 8 in comp else 1.0, 0))
    monkeypatch.setattr(composition_rules.CompositionRules, "_loses_on_horizon",
                        lambda self, *a: weighed.append(a[-1]))
    # a split within `reverse_after_s` of a merge is still refused, even one better by the
    # margin on the window (the replay now prefers CP-2 halves)
    monkeypatch.setattr(composition_rules, "replay_ttft",
                        lambda comp, *a: (0.5 if 2 in comp else 1.0, 0))
    assert best(("merge", split_at), "none")[0] is None
    assert best((None, -float("inf")), "none")[0] == [("split", [0], [2, 2])]
    monkeypatch.setattr(composition_rules, "replay_ttft",
                        lambda comp, *a: (0.5 if 8 in comp else 1.0, 0))
    # ... but not where the window's requests found a cached prefix (the replay cannot price
    # what a merge does to cached context: eval/RESULTS.md items 22, 27)
    cached = [(t, n, 512 if i == 3 else 0) for i, (t, n, _) in enumerate(sample)]
    assert best(("split", split_at), "better", cached)[0] is None
    assert best((None, -float("inf")), "none", cached)[0] == [("merge", [0, 1], [8])]
    # past `reverse_after_s` it is a plain change again
    ops, _, undoing = best(("split", 100.0 - cfg.reverse_after_s - 1.0), "none")
    assert ops == [("merge", [0, 1], [8])] and not undoing


def test_the_arrivals_kept_are_those_of_the_last_reverse_after_s():
    # `observe` keeps each arrival for `reverse_after_s` (at most `SINCE_KEPT * max_samples`);
    # with `reverse_after_s` 0 it keeps none (and does not fail)
    from serving.policy.composition import SINCE_KEPT

    def kept(cfg, times):
        ctl = CompositionController(cfg, lambda c: 100_000)
        for i, t in enumerate(times):
            blocks = chain_block_hashes([2 * i, 2 * i + 1])
            ctl.observe(Request(f"r{i}", t, 1000, 1, blocks, 512), 0, t)
        return [t for t, _, _ in ctl._since]
    assert kept(CompositionConfig(reverse_after_s=10.0), [0.0, 5.0, 10.0, 12.0]) == [5.0, 10.0,
                                                                                     12.0]
    assert kept(CompositionConfig(reverse_after_s=0.0), [0.0, 1.0, 2.0]) == []
    n = 2 * SINCE_KEPT + 5
    assert kept(CompositionConfig(max_samples=2), [float(t) for t in range(n)]) == [
        float(t) for t in range(5, n)]


def _step_back_best(monkeypatch, *, loses_after_the_window=False, outstanding=0.0, load=None):
    """`_best` on four CP-4 a minute after a split, a target of two CP-8 better by the margin,
    the replay stubbed to favour CP-8 on the window (40 arrivals) and, with
    `loses_after_the_window`, to disfavour it on longer arrivals (the last `reverse_after_s`
    kept: 160); `outstanding` seconds queued on each worker, `load` (the load with a CP-8, the
    load without) stubbing `pool_load`. Returns the controller and `_best`'s ops."""
    from serving.policy.scheduler import Scheduler
    from tests.serving.policy.scheduler_fixtures import Backend
    import serving.policy.composition_horizon as composition_horizon
    sched = Scheduler(layout_workers([4, 4, 4, 4], 10_000, 100_000), COST, VertumnusRouter(),
                      Backend())
    for w in sched.workers.values():
        w.queued_seconds = outstanding

    def replay(comp, window, *a):
        if loses_after_the_window and len(window.arrivals) > 40:
            return (2.0 if 8 in comp else 1.0, 0)
        return (0.5 if 8 in comp else 1.0, 0)
    monkeypatch.setattr(composition_rules, "replay_ttft", replay)
    monkeypatch.setattr(composition_horizon, "replay_ttft", replay)
    monkeypatch.setattr(composition_rules, "target_of", lambda *a: ((8, 8), 0.5, 1.0, 0.0))
    if load is not None:
        monkeypatch.setattr(composition_rules, "pool_load",
                            lambda comp, *a: load[0] if 8 in comp else load[1])
    ctl = CompositionController(CompositionConfig(min_degree=1, max_degree=8), lambda c: 100_000)
    ctl._last = ("split", 40.0)
    ctl._since.extend([(20.0 + 0.5 * i, 1500, 0) for i in range(160)])
    sample = [(0.1 * i, 1000 + 500 * (i % 4), 0) for i in range(40)]
    ops, _, _ = ctl._best(sched, 100.0, sample, False, 4.0)
    return ctl, ops and [(k, old) for k, old, _ in ops]


def test_a_step_back_that_loses_on_the_last_reverse_after_s_is_not_made(monkeypatch):
    # The real horizon check on the arrivals kept (`_since`, 160, more than the window's 40):
    # a step back the window prefers but those arrivals do not is refused, and says why.
    ctl, ops = _step_back_best(monkeypatch)
    assert ops == [("merge", [0, 1])] and ctl._undoing
    monkeypatch.undo()
    ctl, ops = _step_back_best(monkeypatch, loses_after_the_window=True)
    assert ops is None
    assert "not on the last 160 arrivals (80 s)" in ctl._vetoed, ctl._vetoed


def test_a_step_back_counts_the_backlog_to_clear_after_an_overload(monkeypatch):
    # Within `reverse_after_s` of the overload rule's step the backlog to clear by the next
    # evaluation counts (`pool_backlog / interval_s`): a step back leaving the load at 0.95
    # is made with no backlog, refused with one of 0.1 of capacity (3 s queued everywhere).
    cfg = CompositionConfig()
    _, ops = _step_back_best(monkeypatch, load=(0.95, 0.8))
    assert ops == [("merge", [0, 1])]
    monkeypatch.undo()

    real = CompositionController.__init__

    def overloaded(self, *a, **k):  # (the overload rule's step made 30 s ago)
        real(self, *a, **k)
        self._overload_at = 70.0
    monkeypatch.setattr(CompositionController, "__init__", overloaded)
    _, ops = _step_back_best(monkeypatch, load=(0.95, 0.8), outstanding=0.1 * cfg.interval_s)
    assert ops is None
    monkeypatch.undo()
    monkeypatch.setattr(CompositionController, "__init__", overloaded)
    _, ops = _step_back_best(monkeypatch, load=(0.85, 0.8), outstanding=0.1 * cfg.interval_s)
    assert ops == [("merge", [0, 1])]


def test_a_step_back_ends_the_overload(monkeypatch):
    # After the burst's split and the overload rule's steps, the first step back resets the
    # rule's start (`_overload_at`): it starts again only past its margin, 1 + `min_gain`.
    seen = []
    real_tick = CompositionController.tick

    def tick(self, scheduler, now):
        before = len([d for d in self.decisions if d.get("kind") == "merge"])
        real_tick(self, scheduler, now)
        if len([d for d in self.decisions if d.get("kind") == "merge"]) > before:
            seen.append(self._overload_at)
    monkeypatch.setattr(CompositionController, "tick", tick)
    ctl, _ = run()
    assert seen and all(t == -float("inf") for t in seen), seen
    assert any(d.get("kind") == "split" and "overloaded" in d["reason"]
               for d in ctl.decisions), [d["reason"] for d in ctl.decisions if d.get("kind")]
