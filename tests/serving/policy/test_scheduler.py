"""Scheduler core: routing, reservations, protocol errors, exactly-once completion."""

from __future__ import annotations

import pytest

from serving.policy.backend import PrefillResult
from serving.policy.prefix_index import PrefixIndex
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import WorkerSpec, WorkerStatus, homogeneous_degrees, layout_workers


class Cost:
    def predict(self, cp_degree, input_len, cached_len):
        return (input_len - cached_len) / 1000 / cp_degree


class RecordingBackend:
    def __init__(self):
        self.started = []

    def start_prefill(self, worker_id, request, now):
        self.started.append((worker_id, request.request_id, now))


def req(rid, length=1000, t=0.0, ids=None):
    ids = ids if ids is not None else [hash((rid, k)) for k in range(-(-length // 512))]
    return Request(rid, t, length, 1, chain_block_hashes(ids), 512)


def make(degrees=(1, 1, 1, 1)):
    backend, done = RecordingBackend(), []
    s = Scheduler(layout_workers(list(degrees), 100, 100_000), Cost(), LeastWorkRouter(), backend,
                  done.append)
    return s, backend, done


def test_burst_spreads_because_reservations_are_immediate():
    s, backend, _ = make()
    placed = [s.submit(req(i, 2000), 0.0) for i in range(8)]
    assert sorted(placed) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [w.outstanding_seconds(0.0) for w in s.workers.values()] == pytest.approx([4.0] * 4)
    assert len(backend.started) == 4  # one running per worker, the rest queued


def test_idle_ties_rotate_not_biased_to_worker_zero():
    s, _, done = make()
    first = []
    for i in range(4):
        w = s.submit(req(i), float(i))
        first.append(w)
        s.complete(w, i, float(i), PrefillResult(0, float(i), float(i)))
    assert sorted(first) == [0, 1, 2, 3]
    assert len(done) == 4


def test_complete_dispatches_next_and_applies_kv_events():
    s, backend, done = make((1,))
    a, b = req("a", 1024, ids=[1, 2]), req("b", 1500, ids=[1, 2, 3])
    s.submit(a, 0.0)
    s.submit(b, 0.1)
    assert backend.started == [(0, "a", 0.0)]
    s.complete(0, "a", 1.0, PrefillResult(0, 1.0, 1.2, inserted_blocks=a.block_hashes))
    assert backend.started[-1] == (0, "b", 1.0)
    assert s.prefix_index.match_blocks(b.block_hashes, b.max_cacheable_blocks, [0]) == [2]
    s.complete(0, "b", 1.5, PrefillResult(1024, 1.5, 1.5, evicted_blocks=[a.block_hashes[1]]))
    assert s.prefix_index.match_blocks(b.block_hashes, 2, [0]) == [1]
    assert [r.request.request_id for r in done] == ["a", "b"]
    assert done[0].ttft == pytest.approx(1.2) and done[1].cached_len == 1024
    assert s.num_in_flight == 0 and s.workers[0].outstanding_seconds(2.0) == 0.0


def test_protocol_errors_and_duplicates():
    s, _, done = make((1,))
    s.submit(req("a"), 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        s.submit(req("a"), 0.0)
    with pytest.raises(ValueError, match="not running request 'b'"):
        s.complete(0, "b", 1.0, PrefillResult(0, 1.0, 1.0))
    s.fail(0, "a", 1.0, "out of KV blocks")
    assert done[0].error == "out of KV blocks" and s.num_failed == 1 and s.num_in_flight == 0


def test_too_long_fails_explicitly_and_draining_waits():
    s, backend, done = make((2, 2))
    s.submit(req("long", 200_000), 0.0)
    assert done[-1].error is not None and "input_len=200000" in done[-1].error
    for w in s.workers.values():
        w.status = WorkerStatus.DRAINING
    assert s.submit(req("x"), 0.0) is None
    assert backend.started == [] and s.num_in_flight == 1
    s.workers[1].status = WorkerStatus.ACTIVE
    s.tick(1.0)
    assert backend.started == [(1, "x", 1.0)]


def test_prefix_index_match():
    idx = PrefixIndex()
    h = chain_block_hashes([1, 2, 3, 4])
    idx.insert(0, h)
    idx.insert(1, h[:2])
    idx.insert(2, h[1:])  # holds later blocks only: no leading match
    assert idx.match_blocks(h, 4, [0, 1, 2, 3]) == [4, 2, 0, 0]
    assert idx.match_blocks(h, 3, [0]) == [3]
    idx.evict(0, h[2:3])
    assert idx.match_blocks(h, 4, [0]) == [2]
    assert idx.global_match_blocks(h, 4) == 4  # block 2 still on worker 2
    idx.drop_worker(2)
    assert idx.global_match_blocks(h, 4) == 2


def test_worker_layout_validation():
    specs = layout_workers([2, 4, 1, 1], 10, 1000)
    assert [(w.cp_degree, w.first_device) for w in specs] == [(4, 0), (2, 4), (1, 6), (1, 7)]
    assert homogeneous_degrees(40, 4) == [4] * 10
    with pytest.raises(ValueError, match="power of two"):
        layout_workers([3], 10, 1000)
    with pytest.raises(ValueError, match="multiple of cp_degree"):
        homogeneous_degrees(10, 4)
    with pytest.raises(ValueError, match="aligned"):
        WorkerSpec(0, 4, 2, 10, 100)


def test_request_validation():
    with pytest.raises(ValueError, match="block_hashes must have"):
        Request("a", 0.0, 1000, 1, (1,), 512)
    with pytest.raises(ValueError, match="input_len"):
        Request("a", 0.0, 0, 1, (), 512)
    with pytest.raises(ValueError, match="arrival_time"):
        Request("a", float("nan"), 10, 1, (1,), 512)
    r = Request("a", 0.0, 1024, 1, (1, 2), 512)
    assert (r.max_cacheable_blocks, r.full_blocks) == (1, 2)


def test_pending_prefixes_count_promised_blocks_until_the_prefill_ends():
    from serving.policy.cost_router import VertumnusRouter

    backend, done = RecordingBackend(), []
    s = Scheduler(layout_workers([1, 1], 100, 100_000), Cost(), VertumnusRouter(lam=0.0), backend,
                  done.append)
    a = req("a", 4096, ids=list(range(8)))
    b = req("b", 4096 + 512, ids=list(range(8)) + [99])
    s.submit(a, 0.0)
    _, matched = s.eligible(b)
    # worker 0 runs a: its 8 full blocks are promised, capped at b's 8 cacheable blocks.
    assert matched == [8, 0]
    assert s.submit(b, 1.0) == 0  # 3.1 s of queue left + 0.5 s beats a cold 4.6 s elsewhere
    s.complete(0, "a", 1.5, PrefillResult(0, 1.5, 1.5, inserted_blocks=a.block_hashes))
    assert len(s.pending) == 9  # only b's promises are left (8 shared + its own 9th block)
    s.complete(0, "b", 2.0, PrefillResult(4096, 2.0, 2.0, inserted_blocks=b.block_hashes[8:]))
    assert len(s.pending) == 0
    # Draining drops the promises of re-routed requests.
    for rid, last in (("c", 4), ("d", 5), ("e", 6)):  # c and d run, e queues behind one
        s.submit(req(rid, 2048, ids=[1, 2, 3, last]), 3.0)
    promised = lambda: sum(sum(per.values()) for per in s.pending._count.values())
    assert promised() == 12
    from serving.policy.worker import merge_buddies
    ws = list(s.workers.values())
    merged = merge_buddies(ws[0].spec, ws[1].spec, 7, lambda c: 100_000)
    s.begin_reconfiguration("merge", [0, 1], [merged], 3.5)
    # e now waits for the merged worker (both old ones drain); only c's and d's promises remain.
    assert promised() == 8 and s.num_in_flight == 3


def test_shared_blocks_are_read_live_and_events_for_them_ignored():
    idx = PrefixIndex()
    idx.insert(0, [1, 2])
    cache = {5: None, 6: 5}  # a worker cache keyed by block hash (as the simulator's LRU)
    with pytest.raises(ValueError, match="worker 0: the shared blocks"):
        idx.share_blocks(0, cache.keys())  # would silently change what the index reports
    assert idx.match_blocks([1, 2], 2, [0]) == [2]  # unchanged by the refused call
    idx.share_blocks(1, cache.keys())
    idx.insert(1, [5, 6])  # the owner reports its events too: no-ops for a shared worker
    cache[7] = 6
    assert idx.match_blocks([5, 6, 7], 3, [0, 1]) == [0, 3]  # read live
    del cache[6]
    idx.evict(1, [6])
    assert idx.match_blocks([5, 6, 7], 3, [1]) == [1]
    assert idx.global_match_blocks([1, 2, 9], 3) == 2 and idx.holders(5) == frozenset({1})
    assert len(idx) == 4 and idx.num_blocks(1) == 2
    assert sorted(idx.drop_worker(1)) == [5, 7]
    idx.insert(1, [8])  # a new worker 1 (not shared) keeps its own copy again
    cache[8] = None
    assert idx.match_blocks([8], 1, [1]) == [1] and idx.num_blocks(1) == 1


def test_shared_blocks_must_be_set_like():
    idx = PrefixIndex()
    with pytest.raises(TypeError, match="set-like"):
        idx.share_blocks(0, [1, 2, 3])
    assert idx.num_blocks(0) == 0


def test_collaborators_share_the_schedulers_state_which_is_fixed():
    """`reconfig` and `copies` own their state; the workers, index and backend they read are the
    scheduler's own objects, which cannot be swapped under them."""
    s, backend, _ = make((2, 2))
    assert s.copies._workers is s.workers and s.copies._index is s.prefix_index
    for name, value in (("workers", {}), ("prefix_index", PrefixIndex()), ("backend", backend)):
        with pytest.raises(AttributeError):
            setattr(s, name, value)
    assert s.epoch == s.reconfig.epoch == 0 and s.new_worker_ids(2) == (2, 3)
    assert s.reconfig.new_worker_ids(1) == (4,)  # one counter, owned by `reconfig`


def test_abort_withdraws_queued_and_pending_never_running():
    s, backend, done = make((1, 1))
    for i in range(4):  # 0, 1 run; 2, 3 queue
        s.submit(req(i, 2000), 0.0)
    queued_worker = s._placements[2].worker
    before = queued_worker.queued_seconds
    assert not s.abort(0, 0.1, "gone")  # running: never dropped
    assert s.abort(2, 0.1, "gone") and not s.abort(2, 0.1, "gone")
    assert before == pytest.approx(2.0) and queued_worker.queued_seconds == 0.0
    assert not queued_worker.queue
    assert done[-1].aborted and done[-1].error == "gone" and done[-1].request.request_id == 2
    assert s.num_in_flight == 3 and s.num_aborted == 1
    for w in (0, 1):  # the rest run to completion; 2 never starts
        s.complete(w, w, 1.0, PrefillResult(0, 1.0, 1.0))
    s.complete(s._placements[3].worker.worker_id, 3, 2.0, PrefillResult(0, 2.0, 2.0))
    assert 2 not in [rid for _, rid, _ in backend.started] and s.num_in_flight == 0
    assert sorted(r.request.request_id for r in done if r.ok) == [0, 1, 3]


def test_a_change_that_strands_waiting_requests_is_refused_whole():
    from serving.policy.reconfiguration import StrandedRequests
    from serving.policy.worker import split_halves
    limit = lambda c: 1000 * c + 1000  # noqa: E731 (CP-1 holds 2,000 tokens, CP-2 3,000)
    done = []
    s = Scheduler([WorkerSpec(0, 2, 0, 200, limit(2)), WorkerSpec(1, 2, 2, 200, limit(2))],
                  Cost(), LeastWorkRouter(), RecordingBackend(), done.append)
    for i in range(4):  # two run, two queue: all 2,500 tokens
        s.submit(req(i, 2500), 0.0)
    rec = s.begin_reconfiguration("split", [0], split_halves(s.workers[0].spec,
                                                             s.new_worker_ids(2), limit), 0.1)
    queued = [r.request_id for r in s.workers[1].queue]
    assert sorted(queued) == [2, 3]  # worker 0's queued request moved to worker 1, which holds it
    halves = split_halves(s.workers[1].spec, s.new_worker_ids(2), limit)
    with pytest.raises(StrandedRequests, match="up to 2500 tokens") as e:
        s.begin_reconfiguration("split", [1], halves, 0.2)
    assert [r.request_id for r in e.value.requests] == queued and e.value.largest == 2000
    # nothing changed
    assert s.workers[1].status is WorkerStatus.ACTIVE and list(s.reconfig.in_progress) == [rec.epoch]
    assert [r.request_id for r in s.workers[1].queue] == queued and not done
    assert s.new_worker_ids(2) == (4, 5)  # the refused split's ids are handed out again
