"""Hooks that call back into the scheduler while it is mid-step (a loss, a drain, a dispatch):
each request still ends in exactly one record, and no change or worker is left stuck (the
breaker's findings of the twenty-second session; each case fails on the code before)."""

from __future__ import annotations

from serving.policy.backend import PrefillResult
from serving.policy.worker import merge_buddies, split_halves
from tests.serving.policy.scheduler_fixtures import HOLDS, make, req


def run_out(s, t=1.0):
    """Completes whatever runs until nothing does; returns the time reached."""
    while any(w.running is not None for w in s.workers.values()):
        for w in list(s.workers.values()):
            if w.running is not None:
                s.complete(w.worker_id, w.running.request_id, t, PrefillResult(0, t, t))
                t += 1.0
    return t


def test_a_request_a_loss_takes_off_its_queue_is_in_flight_while_the_loss_fails_others():
    # losing worker 0 fails its running request (the listener hears of it) before the loss
    # places the requests queued there again: one of them could not be withdrawn then (abort
    # said False) and a second request under its id was taken, queued twice
    s, _, done, _ = make((1, 1))
    for i in range(4):  # 0 runs on worker 0, 1 on worker 1; 2 and 3 queue, one on each
        s.submit(req(i, 0.01 * i), 0.01 * i)
    [queued] = [r.request_id for r in s.workers[0].queue]
    out = []

    def listener(record):
        done.append(record)
        if record.request.request_id == 0:
            out.append(s.abort(queued, 0.5, "client gone"))

    s.listener = listener
    lost = s.lose_workers([0], 0.5, "host 0 died")
    assert out == [True] and lost.rerouted == () and s.num_in_flight == 2
    run_out(s)
    assert sorted((r.request.request_id, r.aborted) for r in done) == [
        (0, False), (1, False), (queued, True), (3, False)]
    assert s.num_in_flight == 0


def test_a_refused_hook_that_aborts_another_unholdable_request_does_not_stop_the_loss():
    # merging workers 0 and 1 (CP-1 each) would hold 60,000-token prompts: two wait for it.
    # Losing worker 0 abandons the merge, so both fail as no worker holds them; a refused
    # hook aborting the second used to make the loss raise halfway (the requests queued on
    # worker 3 were never placed again, and never ended)
    s, _, done, _ = make((1, 1, 1, 1))
    a, b = s.workers[0].spec, s.workers[1].spec
    s.begin_reconfiguration("merge", [0, 1], [merge_buddies(a, b, s.new_worker_ids(1)[0],
                                                            HOLDS)], 0.0)
    s.submit(req("big1", 0.1, 60_000), 0.1)
    s.submit(req("big2", 0.2, 60_000), 0.2)
    for i in range(4):  # 0 and 1 run on workers 2 and 3; 2 and 3 queue behind them
        s.submit(req(i, 0.3), 0.3)
    s.refused_hooks.append(lambda r, now: s.abort("big2", now, "client gone"))
    lost = s.lose_workers([0, 3], 1.0, "host died")
    assert lost.failed_unplaceable == ("big1",) and s.membership.log[-1]["kind"] == "lost"
    run_out(s, 2.0)
    ends = {r.request.request_id: (r.aborted, r.error is None) for r in done}
    assert ends == {"big1": (False, False), "big2": (True, False), 0: (False, True),
                    1: (False, False), 2: (False, True), 3: (False, True)}
    assert len(done) == 6 and s.num_in_flight == 0


def test_a_change_begun_by_a_dispatch_hook_whose_start_then_fails_is_recarved():
    s, backend, done, _ = make((2,))

    def split_it(request, worker_id, now):  # e.g. a controller acting as a prefill starts
        s.begin_reconfiguration("split", [worker_id], split_halves(
            s.workers[worker_id].spec, s.new_worker_ids(2), HOLDS), now)

    def refuse(worker_id, request, now):
        raise OSError("device lost")

    s.dispatch_hooks.append(split_it)
    backend.start_prefill = refuse
    s.submit(req(0), 0.0)
    # the start failed and the drained worker is idle: its re-carve starts (before, never)
    assert done[0].error == "dispatch failed: OSError: device lost"
    assert [rec.old_ids for rec in backend.recarves] == [(0,)]
    rec = backend.recarves[0]
    s.finish_reconfiguration(rec.epoch, 0.5, {})
    assert s.composition == [1, 1] and s.num_in_flight == 0


def test_a_dispatch_hook_that_loses_the_worker_starts_no_prefill():
    s, backend, done, _ = make((1, 1))
    s.dispatch_hooks.append(
        lambda r, worker_id, now: s.lose_workers([worker_id], now, "host 0 died"))
    s.submit(req(0), 0.0)
    assert backend.started == [] and [r.error for r in done] == [
        "host 0 died: worker 0 on host 0 was lost while running this prefill"]
    assert s.num_in_flight == 0


def test_a_loss_by_a_placement_hook_during_a_drain_abandons_the_change_cleanly():
    s, backend, _, _ = make((2, 2))
    for i in range(4):  # 0 and 1 run; 2 and 3 queue, one on each worker
        s.submit(req(i, 0.01 * i), 0.01 * i)
    hit = []

    def lose_it(request, cached, now):
        if s.rerouting and not hit:
            hit.append(s.lose_workers([0], now, "host 0 died"))

    s.placement_hooks.append(lose_it)
    rec = s.begin_reconfiguration("split", [0], split_halves(
        s.workers[0].spec, s.new_worker_ids(2), HOLDS), 0.1)  # (before: KeyError)
    assert hit[0].abandoned_epochs == (rec.epoch,) and not s.reconfig.in_progress
    assert list(s.workers) == [1] and backend.recarves == [] and s.num_in_flight == 3


def test_submit_names_the_worker_a_placement_hook_moved_the_request_to():
    s, _, _, _ = make((2, 2))
    s.submit(req(0), 0.0)
    s.submit(req(1), 0.0)

    def drain_its_worker(request, cached, now):
        if request.request_id == 2 and not s.rerouting:
            w = s._placements[2].worker.worker_id
            s.begin_reconfiguration("split", [w], split_halves(
                s.workers[w].spec, s.new_worker_ids(2), HOLDS), now)

    s.placement_hooks.append(drain_its_worker)
    placed = s.submit(req(2, 0.1), 0.1)
    assert placed == s._placements[2].worker.worker_id and s.workers[placed].status.name == \
        "ACTIVE"
