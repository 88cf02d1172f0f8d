"""Losing a host's workers at once and adding a host back (issue 19): re-routing, exactly one
record per request, the trie, copies, reconfigurations and the controller's GPU count."""

from __future__ import annotations

import collections

import pytest

from serving.policy.backend import PrefillResult
from serving.policy.controller import ControllerConfig, ReconfigurationController
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import WorkerSpec, WorkerStatus, layout_workers
from tests.serving.policy.scheduler_fixtures import Backend


class Cost:
    def predict(self, c, n, h):
        return (n - h) / 1000 / c


def req(rid, length=1000, ids=None):
    ids = ids if ids is not None else [hash((rid, k)) for k in range(-(-length // 512))]
    return Request(rid, 0.0, length, 1, chain_block_hashes(ids), 512)


def make(degrees=(2, 2, 2, 2), per_host=4, max_len=100_000):
    """Two hosts of 4 GPUs: workers 0, 1 on host 0; 2, 3 on host 1 (by default)."""
    backend, records = Backend(), []
    s = Scheduler(layout_workers(list(degrees), 100, max_len, devices_per_host=per_host), Cost(),
                  LeastWorkRouter(), backend, records.append, prefix_index=GlobalPrefixTrie())
    return s, backend, records


def running(s):
    return {w: st.running.request_id for w, st in s.workers.items() if st.running is not None}


def test_a_lost_host_reroutes_queued_fails_running_once_and_leaves_the_trie():
    s, backend, records = make()
    ctl = ReconfigurationController(ControllerConfig(), 8, lambda c: 100_000)
    ctl.attach(s)
    for i in range(8):  # one running and one queued per worker
        s.submit(req(i), 0.0)
    queued = {w: [r.request_id for r in st.queue] for w, st in s.workers.items()}
    assert all(len(q) == 1 for q in queued.values())
    shared = req("p", 2048, ids=[1, 2, 3, 4])
    s.prefix_index.insert(0, shared.block_hashes)
    s.prefix_index.insert(2, shared.block_hashes[:2])
    was_running = running(s)
    out = s.lose_workers([0, 1], 0.5, "host 0 agent died")
    assert out.worker_ids == (0, 1) and out.hosts == (0,) and out.gpus == 4
    assert sorted(out.failed_running) == sorted([was_running[0], was_running[1]])
    assert sorted(out.rerouted) == sorted(queued[0] + queued[1]) and not out.failed_unplaceable
    failed = [r for r in records if not r.ok]
    assert len(failed) == 2 and all(r.error.startswith("host 0 agent died: worker ")
                                    and "on host 0 was lost" in r.error for r in failed)
    assert all(r.retryable for r in failed)  # not the request's fault: the API answers 503
    # the workers left the pool and the trie; the controller counts the GPUs left
    assert sorted(s.workers) == [2, 3] and s.composition == [2, 2] and ctl.num_gpus == 4
    assert s.prefix_index.num_blocks(0) == 0 and 0 not in s.prefix_index.holders(
        shared.block_hashes[0])
    assert s.prefix_index.match_blocks(shared.block_hashes, 4, [0, 2]) == [0, 2]
    # A late report of the dead host is ignored (the request already has its error record).
    s.complete(0, was_running[0], 0.6, PrefillResult(0, 0.6, 0.6))
    s.fail(1, was_running[1], 0.6, "connection reset")
    assert len(records) == 2
    # The re-routed requests run on host 1; every request ends exactly once.
    t = 1.0
    while s.num_in_flight:
        for w, rid in running(s).items():
            s.complete(w, rid, t, PrefillResult(0, t, t))
            t += 0.1
    count = collections.Counter(r.request.request_id for r in records)
    assert sorted(count) == list(range(8)) and set(count.values()) == {1}
    assert {r.worker_id for r in records if r.ok} == {2, 3}
    # The host comes back as new workers, schedulable at once.
    new = [WorkerSpec(w, 2, 2 * k, 200, 100_000, host=0)
           for k, w in enumerate(s.new_worker_ids(2))]
    states = s.add_workers(new, 5.0)
    assert [st.worker_id for st in states] == [4, 5] and ctl.num_gpus == 8
    assert all(st.status is WorkerStatus.ACTIVE for st in states)
    for i in range(10, 14):
        s.submit(req(i), 5.0)
    assert set(running(s)) == {2, 3, 4, 5}
    assert s.membership.log[0]["kind"] == "lost" and s.membership.log[1]["kind"] == "added"


def test_bad_calls_change_nothing():
    s, _, records = make()
    s.submit(req("a"), 0.0)
    with pytest.raises(ValueError, match="unknown: \\[9\\]"):
        s.lose_workers([0, 9], 1.0, "host 0 died")
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        s.lose_workers([0], 1.0, "")
    assert sorted(s.workers) == [0, 1, 2, 3] and not records
    s.lose_workers([0, 1], 1.0, "host 0 died")
    again = s.lose_workers([1, 0], 1.5, "host 0 died")  # idempotent
    assert again.worker_ids == () and len(s.membership.log) == 1 and len(records) == 1
    [fresh] = s.new_worker_ids(1)
    for spec, match in [(WorkerSpec(0, 2, 0, 200, 10), "not usable: \\[0\\]"),  # lost: never reused
                        (WorkerSpec(99, 2, 0, 200, 10), "not usable: \\[99\\]"),  # not handed out
                        (WorkerSpec(fresh, 2, 4, 200, 10, host=1), "overlap")]:
        with pytest.raises(ValueError, match=match):
            s.add_workers([spec], 2.0)
    assert sorted(s.workers) == [2, 3]
    with pytest.raises(ValueError, match="must be fresh"):  # nor as a split's new worker
        s.begin_reconfiguration("split", [2], [WorkerSpec(0, 1, 4, 100, 10, host=1),
                                               WorkerSpec(fresh, 1, 5, 100, 10, host=1)], 3.0)


def test_requests_no_worker_left_can_hold_fail_saying_why():
    # host 0: one CP-4 worker for long prompts; host 1: CP-1 workers for short ones only.
    specs = [WorkerSpec(0, 4, 0, 400, 100_000, host=0)] + [
        WorkerSpec(1 + k, 1, 4 + k, 100, 4_000, host=1) for k in range(4)]
    backend, records = Backend(), []
    s = Scheduler(specs, Cost(), LeastWorkRouter(), backend, records.append)
    s.submit(req("long1", 50_000), 0.0)
    s.submit(req("long2", 50_000), 0.0)  # queued behind long1
    s.submit(req("short", 1_000), 0.0)
    out = s.lose_workers(s.membership.host_worker_ids(0), 1.0, "host 0 agent died")
    assert out.failed_running == ("long1",) and out.failed_unplaceable == ("long2",)
    [rec] = [r for r in records if r.request.request_id == "long2"]
    assert "cannot be held by any worker left after losing worker(s) [0] on host(s) [0]" in rec.error
    assert s.num_in_flight == 1  # "short" runs on host 1
    # A new long prompt fails at once; the pool keeps serving short ones.
    s.submit(req("long3", 50_000), 2.0)
    assert "cannot be held by any worker" in records[-1].error


def test_a_change_involving_lost_workers_is_abandoned_cleanly():
    s, backend, records = make((2, 2, 2, 2, 2, 2, 2, 2), per_host=8)  # 0-3 host 0, 4-7 host 1
    s.submit(req("a"), 0.0)  # runs on one worker of host 0
    [w_a] = running(s)
    buddy = w_a ^ 1
    [m_id] = s.new_worker_ids(1)
    lo = min(w_a, buddy)
    draining = s.begin_reconfiguration("merge", [w_a, buddy], [WorkerSpec(
        m_id, 4, 2 * lo, 400, 100_000, host=0)], 0.0)
    assert draining.recarve_started is None  # worker w_a is still running "a"
    # An idle merge on host 1 starts re-carving at once.
    [m2] = s.new_worker_ids(1)
    recarving = s.begin_reconfiguration("merge", [4, 5], [WorkerSpec(
        m2, 4, 8, 400, 100_000, host=1)], 0.0)
    assert backend.recarves == [recarving]
    # Losing the running worker only: the draining change is given up, its buddy works again.
    out = s.lose_workers([w_a], 1.0, "GPU fell off the bus")
    assert out.abandoned_epochs == (draining.epoch,) and out.failed_running == ("a",)
    assert s.workers[buddy].status is WorkerStatus.ACTIVE and w_a not in s.workers
    # Losing the new worker of a change being re-carved: its old workers go too.
    out = s.lose_workers([m2], 2.0, "host 1 agent died")
    assert out.worker_ids == (4, 5) and out.abandoned_epochs == (recarving.epoch,)
    assert not s.reconfig.in_progress
    s.finish_reconfiguration(recarving.epoch, 3.0, {m2: [1, 2]})  # late: ignored
    assert m2 not in s.workers and sorted(s.workers) == sorted({0, 1, 2, 3, 6, 7} - {w_a})
    assert s.prefix_index.num_blocks(m2) == 0
    assert [r.request.request_id for r in records] == ["a"]


def test_copies_and_reclamations_of_lost_workers_fail_and_leave_the_trie_alone():
    s, backend, _ = make()
    chain = chain_block_hashes(range(6))
    s.prefix_index.insert(2, chain)  # host 1
    s.prefix_index.insert(0, chain)  # host 0
    to_lost = s.copies.begin(2, 1, chain, 512, 0.0, "intra-degree")  # into host 0
    from_lost = s.copies.begin(0, 3, chain, 512, 0.0, "intra-degree")  # out of host 0
    s.copies.begin_reclaim(0, chain, 0.0)
    out = s.lose_workers([0, 1], 1.0, "host 0 agent died")
    assert out.failed_copies == 2 and not s.copies.in_flight and not s.copies.reclaims
    assert [f["dst"] for f in s.copies.failed] == [1, 3]
    assert all(f["error"] == "host 0 agent died" for f in s.copies.failed)
    assert s.copies.is_dropped(from_lost)
    # The backend's late reports change nothing.
    s.copies.finish(from_lost, 2.0, list(chain), [])
    s.copies.finish(to_lost, 2.0, list(chain), [])
    s.copies.finish_reclaim(0, chain, 2.0, list(chain))
    assert s.prefix_index.num_blocks(3) == 0 and s.copies.num_copies == 0
    assert s.prefix_index.num_blocks(2) == 6
    # A new copy to worker 3 works as usual.
    rep = s.copies.begin(2, 3, chain, 512, 3.0, "intra-degree")
    s.copies.finish(rep, 4.0, list(chain), [])
    assert s.prefix_index.num_blocks(3) == 6


def test_losing_every_worker_fails_new_requests_until_a_host_comes_back():
    s, _, records = make((2, 2), per_host=4)
    s.submit(req("q"), 0.0)
    s.submit(req("r"), 0.0)
    s.lose_workers([0, 1], 1.0, "the only host died")
    assert not s.workers and s.num_in_flight == 0 and len(records) == 2
    s.submit(req("s"), 2.0)
    assert "cannot be held by any worker" in records[-1].error
    s.add_workers([WorkerSpec(w, 2, 2 * k, 200, 100_000) for k, w in
                   enumerate(s.new_worker_ids(2))], 3.0)
    assert s.submit(req("t"), 4.0) in (2, 3)
