"""A re-routed request is placed again, not submitted again: the controllers count it once."""

from __future__ import annotations

from collections import deque

import pytest

from serving.policy.backend import PrefillResult
from serving.policy.composition import CompositionController
from serving.policy.composition_config import CompositionConfig
from serving.policy.controller import ControllerConfig, ReconfigurationController
from serving.policy.placement import withdraw_queued
from serving.policy.prefix_index import PendingPrefixes
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import WorkerSpec, merge_buddies, split_halves
from tests.serving.policy.scheduler_fixtures import HOLDS, Backend, MsCost, make, req

def test_placement_hooks_see_a_drain_reroute_as_one():
    s, _, _, seen = make((2, 2))
    for i in range(6):  # 0 and 1 run; 2-5 queue, two on each worker
        s.submit(req(i, 0.01 * i), 0.01 * i)
    on0 = [r.request_id for r in s.workers[0].queue]
    assert len(on0) == 2
    s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec, s.new_worker_ids(2),
                                                       HOLDS), 0.1)
    # worker 0's queued requests moved to worker 1, the only ACTIVE one, flagged as re-routes
    assert seen == [(i, False) for i in range(6)] + [(rid, True) for rid in on0]
    assert s.rerouted == set() and s.rerouting is False
    s.submit(req(6, 0.2), 0.2)
    assert seen[-1] == (6, False)


def test_a_reroute_that_waits_is_still_one_and_its_end_clears_the_id():
    s, backend, done, seen = make((1, 1))
    for i in range(4):  # 0 and 1 run; 2 and 3 queue
        s.submit(req(i, 0.01 * i), 0.01 * i)
    ws = list(s.workers.values())
    rec = s.begin_reconfiguration("merge", [0, 1], [merge_buddies(ws[0].spec, ws[1].spec,
                                                                  s.new_worker_ids(1)[0], HOLDS)],
                                  0.1)
    assert s.rerouted == {2, 3} and len(seen) == 4  # both wait: no worker takes placements
    assert s.abort(3, 0.2, "client gone") and s.rerouted == {2}
    for w in (0, 1):
        s.complete(w, w, 1.0, PrefillResult(0, 1.0, 1.0))
    assert backend.recarves == [rec]
    s.finish_reconfiguration(rec.epoch, 1.5, {})
    assert seen[4:] == [(2, True)] and s.rerouted == set()
    assert [r.request.request_id for r in done] == [3, 0, 1]


def test_requests_a_change_displaced_are_placed_again_when_it_is_done():
    # [2, 2], 2,000-token prompts at 1 ms a token over the degree (1 s each): 0 and 1 run,
    # 2-5 queue, two on each worker. Splitting worker 0 moves its two queued requests to
    # worker 1, the only ACTIVE one, behind its own two. When the split is done its halves are
    # idle: the two it displaced, still queued, are placed again, one on each half (least
    # work); worker 1 keeps its own two. Each is one arrival for the placement hooks.
    s, backend, done, seen = make((2, 2))
    for i in range(6):
        s.submit(req(i, 0.01 * i), 0.01 * i)
    on0, on1 = ([r.request_id for r in s.workers[w].queue] for w in (0, 1))
    assert len(on0) == len(on1) == 2
    rec = s.begin_reconfiguration("split", [0], split_halves(
        s.workers[0].spec, s.new_worker_ids(2), HOLDS), 0.1)
    assert rec.displaced == tuple(on0)
    assert [r.request_id for r in s.workers[1].queue] == on1 + on0
    s.complete(0, 0, 1.0, PrefillResult(0, 1.0, 1.0))
    assert backend.recarves == [rec]
    s.finish_reconfiguration(rec.epoch, 1.5, {})
    halves = [spec.worker_id for spec in rec.new_specs]
    assert [r.request_id for r in s.workers[1].queue] == on1
    assert sorted(rid for _, rid in backend.started[-2:]) == on0  # started at once, one a half
    assert {wid for wid, _ in backend.started[-2:]} == set(halves)
    assert seen[-2:] == [(rid, True) for rid in on0] and s.rerouted == set()
    assert s.num_in_flight == 5 and [r.request.request_id for r in done] == [0]
    # Again, but worker 1 gets through its own two and starts the first displaced one before
    # the split is done: that one is left running; only the other is placed again.
    s, backend, done, seen = make((2, 2))
    for i in range(6):
        s.submit(req(i, 0.01 * i), 0.01 * i)
    rec = s.begin_reconfiguration("split", [0], split_halves(
        s.workers[0].spec, s.new_worker_ids(2), HOLDS), 0.1)
    s.complete(0, 0, 1.0, PrefillResult(0, 1.0, 1.0))
    for t, rid in ((1.0, 1), (1.1, on1[0]), (1.2, on1[1])):
        s.complete(1, rid, t, PrefillResult(0, t, t))
    assert backend.started[-1] == (1, on0[0]) and s.workers[1].queue[0].request_id == on0[1]
    s.finish_reconfiguration(rec.epoch, 1.5, {})
    assert backend.started[-1][1] == on0[1] and not s.workers[1].queue
    assert backend.started[-1][0] in [spec.worker_id for spec in rec.new_specs]
    assert seen[-1] == (on0[1], True) and s.num_in_flight == 2


def test_what_waited_while_every_worker_drained_is_spread_when_the_changes_are_done():
    # [2, 2], both split at once (an overload's further splits): no worker takes placements,
    # the six arrivals meanwhile wait. The first change done places them all on its halves
    # (the only workers); they count as displaced by the other change, so when it is done
    # those still queued are placed again, and its halves take their share at once.
    s, backend, done, seen = make((2, 2))
    for i in range(2):  # 0 and 1 run
        s.submit(req(i, 0.01 * i), 0.01 * i)
    recs = [s.begin_reconfiguration("split", [w], split_halves(
        s.workers[w].spec, s.new_worker_ids(2), HOLDS), 0.1) for w in (0, 1)]
    for i in range(2, 8):
        s.submit(req(i, 0.1 * i), 0.1 * i)
    assert s.num_in_flight == 8 and not backend.started[2:]  # six waiting
    s.complete(0, 0, 1.0, PrefillResult(0, 1.0, 1.0))
    s.finish_reconfiguration(recs[0].epoch, 1.5, {})
    first = [spec.worker_id for spec in recs[0].new_specs]
    assert sorted(w for w, _ in backend.started[2:]) == first  # one runs on each half
    assert sum(len(s.workers[w].queue) for w in first) == 4
    assert set(recs[1].displaced) == set(range(2, 8))
    s.complete(1, 1, 1.6, PrefillResult(0, 1.6, 1.6))
    s.finish_reconfiguration(recs[1].epoch, 2.0, {})
    second = [spec.worker_id for spec in recs[1].new_specs]
    assert sorted(w for w, _ in backend.started[4:]) == second  # its halves start at once
    assert sorted(len(s.workers[w].queue) for w in first + second) == [0, 0, 1, 1]
    assert s.num_in_flight == 6 and s.rerouted == set()


def test_composition_controller_counts_a_reroute_older_than_its_memory_once():
    # max_samples=1 keeps the 4 latest placements. Before, a re-routed request whose first
    # placement had left that memory was recorded again, as an arrival at the re-route's time.
    s, _, _, _ = make((2, 2))
    ctl = CompositionController(CompositionConfig(max_samples=1), HOLDS)
    ctl.attach(s)
    for i in range(10):  # 0 and 1 run, 2-9 queue; the memory holds 6-9
        s.submit(req(i, 0.01 * i), 0.01 * i)
    assert [t for t, _, _ in ctl._samples] == pytest.approx([0.06, 0.07, 0.08, 0.09])
    s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec, s.new_worker_ids(2),
                                                       HOLDS), 1.0)
    assert len(s.workers[1].queue) == 8  # the re-routes were placed (on worker 1)
    assert [t for t, _, _ in ctl._samples] == pytest.approx([0.06, 0.07, 0.08, 0.09])
    assert [t for t, _, _ in ctl._horizon] == pytest.approx([0.06, 0.07, 0.08, 0.09])


def test_paper_controller_counts_a_reroute_once():
    s, _, _, _ = make((2, 2))
    ctl = ReconfigurationController(ControllerConfig(), 4, HOLDS)
    ctl.attach(s)
    for i in range(6):
        s.submit(req(i, 0.01 * i), 0.01 * i)
    gpu_s = ctl._gpu_s
    # each arrival counts its GPU-seconds at the smallest degree (1): 2,000 tokens = 2 s
    assert len(ctl._arrivals) == 6 and gpu_s == pytest.approx(6 * 2.0)
    s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec, s.new_worker_ids(2),
                                                       HOLDS), 0.1)
    assert len(ctl._arrivals) == 6 and ctl._gpu_s == gpu_s


def test_withdraw_queued_releases_everything_or_nothing():
    s, _, _, _ = make((1,))
    for i in range(3):  # 0 runs; 1 and 2 queue
        s.submit(req(i), 0.0)
    pending = PendingPrefixes()
    w = s.workers[0]
    pending.add(0, req(1).block_hashes[:3])  # (its full blocks, as the scheduler promises)
    assert pending.extend_matches(req(1).block_hashes, 3, [0], [0]) == [3]
    assert withdraw_queued(s._placements, 0, pending) is None  # running: unchanged
    assert 0 in s._placements and [r.request_id for r in w.queue] == [1, 2]
    assert w.queued_seconds == pytest.approx(4.0)
    assert withdraw_queued(s._placements, 1, pending).request_id == 1
    assert [r.request_id for r in w.queue] == [2] and 1 not in s._placements
    assert w.queued_seconds == pytest.approx(2.0)
    assert pending.extend_matches(req(1).block_hashes, 3, [0], [0]) == [0]
    with pytest.raises(KeyError):
        withdraw_queued(s._placements, 1, None)


def test_a_router_error_while_rerouting_fails_that_request_and_loses_none():
    s, _, done, seen = make((2, 2))
    for i in range(6):
        s.submit(req(i, 0.01 * i), 0.01 * i)
    on0 = [r.request_id for r in s.workers[0].queue]
    choose = s.router.choose

    def broken_once(request, candidates, matched, now):
        if request.request_id == on0[0]:
            raise RuntimeError("router bug")
        return choose(request, candidates, matched, now)

    s.router.choose = broken_once
    s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec, s.new_worker_ids(2),
                                                       HOLDS), 0.1)
    # the change is made; the request the router failed on ended with that error, the other
    # one was placed again (before, the error came out of the drain and both were taken off
    # the queue and never seen again); the error is kept
    assert s.workers[0].status.name == "DRAINING" and len(s.reconfig.in_progress) == 1
    assert list(s.membership.errors) == [
        {"time": 0.1, "request_id": on0[0], "error": "RuntimeError: router bug"}]
    assert [(r.request.request_id, r.error) for r in done] == [
        (on0[0], "routing failed: RuntimeError: router bug")]
    assert seen[6:] == [(on0[1], True)] and s.rerouted == set()
    assert s.num_in_flight == 5


def test_a_hook_that_raises_or_places_another_request_leaves_the_flag_right():
    s, _, _, seen = make((2, 2))
    ctl = CompositionController(CompositionConfig(max_samples=100), HOLDS)
    for i in range(6):
        s.submit(req(i, 0.01 * i), 0.01 * i)
    on0 = [r.request_id for r in s.workers[0].queue]
    follow = []

    def hook(request, cached, now):  # a plug-in: submits a follow-up for a re-route, then fails
        if s.rerouting and not follow:
            follow.append(request.request_id)
            s.submit(req(100, now), now)  # a new arrival, placed from inside the hook
        if request.request_id == on0[1]:
            raise ValueError("hook bug")

    s.placement_hooks.insert(0, hook)
    ctl.attach(s)  # its `observe` runs after the plug-in's hook
    s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec, s.new_worker_ids(2),
                                                       HOLDS), 0.1)
    assert follow == [on0[0]]
    assert [e["error"] for e in s.membership.errors] == ["ValueError: hook bug"]
    # the follow-up counted as an arrival, neither re-route did (the one whose hook raised
    # was placed: it stays placed and its id is not left behind)
    assert seen[6:] == [(100, False), (on0[0], True)]
    assert [t for t, _, _ in ctl._samples] == [0.1]
    assert s.rerouting is False and s.rerouted == set()
    assert on0[1] in s._placements and s.num_in_flight == 7


def test_a_hook_error_after_a_placement_leaves_the_request_in_flight():
    s, backend, done, _ = make((2,))

    def hook(request, cached, now):
        raise RuntimeError("hook bug")

    s.placement_hooks.append(hook)
    # taken: the error is kept, not raised (a caller reading a raise as "not taken" would
    # drop a request that runs), and submit names the worker
    assert s.submit(req(0), 0.0) == 0
    assert [e["error"] for e in s.membership.errors] == ["RuntimeError: hook bug"]
    # placed and running: it is in flight (before, it was uncounted and later went negative)
    assert backend.started == [(0, 0)] and s.num_in_flight == 1
    s.complete(0, 0, 1.0, PrefillResult(0, 1.0, 1.0))
    assert s.num_in_flight == 0 and [r.request.request_id for r in done] == [0]


def test_a_hook_that_ends_its_own_request_then_raises_gives_one_record():
    # the breaker's case: a placement hook aborts the request it is told of, then raises; the
    # request has its abort record and no other, and is not counted twice
    s, _, done, _ = make((2, 2))
    for i in range(6):
        s.submit(req(i, 0.01 * i), 0.01 * i)
    on0 = [r.request_id for r in s.workers[0].queue]

    def hook(request, cached, now):
        if request.request_id == on0[0]:
            s.abort(request.request_id, now, "admission")
            raise RuntimeError("hook bug")

    s.placement_hooks.insert(0, hook)
    s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec, s.new_worker_ids(2),
                                                       HOLDS), 0.1)
    assert [(r.request.request_id, r.error) for r in done] == [(on0[0], "admission")]
    assert s.num_in_flight == 5 and on0[1] in s._placements
    # at submit: it ended (aborted) before the hook raised; kept, counted once
    assert s.submit(req(on0[0], 0.2), 0.2) is None
    assert len(s.membership.errors) == 2 and s.num_in_flight == 5 and s.num_aborted == 2


def test_a_refused_hook_error_neither_uncounts_nor_stops_a_loss():
    # CP-2 holds 3,000 tokens, CP-1 2,000: losing the CP-2 worker fails its 2,500-token
    # requests as no worker left holds them; a refused hook that raises on the first one used
    # to stop the loss there (the second one never ended)
    specs = [WorkerSpec(0, 2, 0, 200, 3000), WorkerSpec(1, 1, 2, 200, 2000),
             WorkerSpec(2, 1, 3, 200, 2000)]
    done = []
    s = Scheduler(specs, MsCost(), LeastWorkRouter(), Backend(), done.append)

    def refused(request, now):
        raise RuntimeError("refused hook bug")

    s.refused_hooks.append(refused)
    assert s.submit(req("huge", 0.0, 4000), 0.0) is None  # no worker holds 4,000: it failed
    assert s.num_in_flight == 0 and done[-1].error.startswith("input_len=4000")
    for i in range(3):  # one runs on worker 0, two queue there
        s.submit(req(i, 0.01, 2500), 0.01)
    lost = s.lose_workers([0], 0.5, "host 0 died")
    assert lost.failed_running == (0,) and lost.failed_unplaceable == (1, 2)
    assert sorted(r.request.request_id for r in done[1:]) == [0, 1, 2]
    assert s.num_in_flight == 0 and len(s.membership.errors) == 3  # the submit's kept too
    assert s.membership.log[-1]["kind"] == "lost"


def test_a_dispatch_error_fails_that_request_and_the_worker_goes_on():
    # before, `running` was set before the dispatch hooks and the backend ran: an error there
    # left the worker "running" a request the backend never got, and everything behind it
    s, backend, done, _ = make((2,))

    def hook(request, worker_id, now):
        if request.request_id in (1, 2):
            raise RuntimeError(f"dispatch hook bug {request.request_id}")

    s.dispatch_hooks.append(hook)
    for i in range(4):  # 0 runs; 1, 2 and 3 queue
        s.submit(req(i), 0.0)
    s.complete(0, 0, 1.0, PrefillResult(0, 1.0, 1.0))  # 1 and 2 fail to start, 3 starts
    assert backend.started == [(0, 0), (0, 3)]
    assert [(r.request.request_id, r.error) for r in done] == [
        (0, None), (1, "dispatch failed: RuntimeError: dispatch hook bug 1"),
        (2, "dispatch failed: RuntimeError: dispatch hook bug 2")]
    assert s.num_in_flight == 1 and s.workers[0].running.request_id == 3
    assert [e["request_id"] for e in s.membership.errors] == [1, 2]


def test_a_backend_that_refuses_every_start_fails_a_long_queue_without_recursion():
    s, backend, done, _ = make((2,))
    for i in range(3000):  # more than Python's recursion limit, were each failure to recurse
        s.submit(req(i), 0.0)

    def refuse(worker_id, request, now):
        raise OSError("device lost")

    backend.start_prefill = refuse
    s.complete(0, 0, 1.0, PrefillResult(0, 1.0, 1.0))
    assert len(done) == 3000 and s.num_in_flight == 0 and s.workers[0].running is None
    assert done[-1].error == "dispatch failed: OSError: device lost"


def test_a_request_being_placed_again_is_in_flight_to_abort_and_to_duplicates():
    # a drain places worker 0's two queued requests again one at a time; while the first is
    # placed, the second is in no queue yet: before, abort did not find it (False) and a new
    # request with its id was taken (two in flight under one id)
    s, _, done, _ = make((2, 2))
    for i in range(6):  # 0 and 1 run; 2-5 queue, two on each worker
        s.submit(req(i, 0.01 * i), 0.01 * i)
    first, second = [r.request_id for r in s.workers[0].queue]
    seen = []

    def hook(request, cached, now):
        if request.request_id == first:
            with pytest.raises(ValueError, match="already in flight"):
                s.submit(req(second, now), now)
            seen.append(s.abort(second, now, "client gone"))

    s.placement_hooks.append(hook)
    s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec, s.new_worker_ids(2),
                                                       HOLDS), 0.1)
    assert seen == [True] and [(r.request.request_id, r.aborted) for r in done] == [(second, True)]
    assert second not in s._placements and first in s._placements
    assert s.num_in_flight == 5 and s.rerouted == set() and s.membership.placing == []


def test_a_tick_hook_error_still_retries_the_waiting_requests():
    s, _, _, _ = make((1, 1))
    for i in range(3):  # 0 and 1 run; 2 queues
        s.submit(req(i, 0.01 * i), 0.01 * i)
    ws = list(s.workers.values())
    s.begin_reconfiguration("merge", [0, 1], [merge_buddies(ws[0].spec, ws[1].spec,
                                                            s.new_worker_ids(1)[0], HOLDS)], 0.1)
    assert [r.request_id for r in s._pending] == [2]  # no worker takes placements
    retried, place_again = [], s.membership.place_again
    s.membership.place_again = lambda rs, now: (retried.append([r.request_id for r in rs]),
                                                place_again(rs, now))

    def bug(scheduler, now):
        raise RuntimeError("tick hook bug")

    s.tick_hooks.append(bug)
    with pytest.raises(RuntimeError, match="tick hook bug"):  # comes out after the retry
        s.tick(0.2)
    assert retried == [[2]] and [r.request_id for r in s._pending] == [2]


def test_a_router_error_clears_the_routing_state():
    s, _, _, _ = make((2,))

    def choose(request, candidates, matched, now):
        assert s.routing[0] is request  # set while the router chooses
        raise RuntimeError("router bug")

    s.router.choose = choose
    with pytest.raises(RuntimeError, match="router bug"):  # not taken: it comes out
        s.submit(req(0), 0.0)
    assert s.routing is None and s.num_in_flight == 0 and s.membership.errors == deque()
