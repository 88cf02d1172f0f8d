"""The placement cost with a per-request prefix fetch: hand-computed plans and the copy it starts."""

from __future__ import annotations

import pytest

from serving.policy.cost_router import VertumnusRouter
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.prefix_index import PrefixIndex
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import WorkerState, layout_workers

BS = 512


class LinearCost:
    """predict = (L - h) * 1 ms / C: easy to compute by hand."""

    def predict(self, cp_degree: int, input_len: int, cached_len: int) -> float:
        return (input_len - cached_len) * 1e-3 / cp_degree


class FakeScheduler:
    """What the router reaches through `bind`: the cost model, the index, dispatch hooks and
    `copies.fetch_for_request` (records the fetch; None when told to refuse)."""

    def __init__(self, refuse: bool = False) -> None:
        self.cost_model, self.prefix_index = LinearCost(), PrefixIndex()
        self.dispatch_hooks, self.fetched, self.refuse = [], [], refuse
        self.copies = self  # the `PrefixCopies` collaborator's one method the router uses

    def fetch_for_request(self, request, dst, max_blocks, now):
        self.fetched.append((request.request_id, dst, max_blocks, now))
        return None if self.refuse else object()

    def dispatch(self, request, worker_id, now):
        for hook in self.dispatch_hooks:
            hook(request, worker_id, now)


def setup(refuse=False):
    """Workers 0, 1: CP-4; worker 2: CP-2. Worker 0 caches 12 blocks of q, worker 2 four."""
    workers = [WorkerState(s) for s in layout_workers([4, 4, 2], 1000, 1 << 20)]
    q = Request("q", 0.0, 16 * BS, 1, chain_block_hashes(range(16)), BS)
    sched = FakeScheduler(refuse)
    sched.prefix_index.insert(0, q.block_hashes[:12])
    sched.prefix_index.insert(2, q.block_hashes[:4])
    workers[0].queued_seconds, workers[2].queued_seconds = 3.0, 0.5
    return workers, q, sched


def test_fetch_plan_hand_computed_and_the_copy_started():
    workers, q, sched = setup()
    r = FetchingVertumnusRouter(kv_bytes_per_token=100_000, transfer_gb_per_s=1.0)
    r.bind(sched)
    # One block copy: 512 * 1e5 B / 1e9 B/s = 51.2 ms. Best cached prefix: 12 blocks on worker 0.
    # S_0 = (8192 - 6144) / 4 ms = 0.512 (holds it);  C*S = 2.048 (the cheapest)
    # S_1 = min(8.192 / 4, 12 * 0.0512 + 0.512) = 1.1264;  C*S = 4.5056
    # S_2 = min(6.144 / 2, 8 * 0.0512 + 2.048 / 2) = 1.4336;  C*S = 2.8672
    # cost = Q + S + (C*S - 2.048): 3.512, 3.584, 0.5 + 1.4336 + 0.8192 = 2.7528
    plans = r.plans(q, workers, [12, 0, 4], 0.0)
    assert [p[0] for p in plans] == pytest.approx([3.512, 3.584, 2.7528], abs=1e-12)
    assert [p[1:] for p in plans] == [(0, -1, 0), (12, 0, 12), (8, 0, 12)]
    assert r.choose(q, workers, [12, 0, 4], 0.0) == 2
    assert sched.fetched == []  # the fetch is made when q leaves worker 2's queue
    sched.dispatch(q, 2, 0.7)
    assert sched.fetched == [("q", 2, 12, 0.7)] and r.fetches.started == 1
    # The paper's router (local prefixes only) keeps q on worker 0: 3.512 < 7.668 (worker 2).
    plain = VertumnusRouter(cost_model=LinearCost())
    assert plain.costs(q, workers, [12, 0, 4], 0.0) == pytest.approx([3.512, 8.192, 7.668])
    assert plain.choose(q, workers, [12, 0, 4], 0.0) == 0


def test_without_a_cheap_fetch_it_is_the_papers_router():
    workers, q, sched = setup()
    slow = FetchingVertumnusRouter(100_000, transfer_gb_per_s=0.01)  # 5.12 s a block
    slow.bind(sched)
    plain = VertumnusRouter(cost_model=LinearCost())
    for matched in ([12, 0, 4], [12, 3, 4], [13, 0, 9]):  # cached, or more when promised
        assert slow.costs(q, workers, matched, 1.0) == pytest.approx(
            plain.costs(q, workers, matched, 1.0), abs=1e-12)
    assert slow.choose(q, workers, [12, 0, 4], 0.0) == 0
    sched.dispatch(q, 0, 0.0)
    assert sched.fetched == [] and slow.fetches.started == slow.fetches.skipped == 0


def test_a_fetch_not_made_or_run_elsewhere_is_counted_as_skipped():
    workers, q, sched = setup(refuse=True)
    r = FetchingVertumnusRouter(100_000, transfer_gb_per_s=1.0)
    r.bind(sched)
    assert r.choose(q, workers, [12, 0, 4], 0.0) == 2
    sched.dispatch(q, 2, 1.0)  # the scheduler made no copy (nothing longer by then, or refused)
    assert (r.fetches.started, r.fetches.skipped) == (0, 1)
    sched.refuse = False
    assert r.choose(q, workers, [12, 0, 4], 0.0) == 2
    sched.dispatch(q, 1, 2.0)  # re-routed and started on another worker: no fetch for it
    assert (r.fetches.started, r.fetches.skipped) == (0, 2) and len(sched.fetched) == 1


def test_equal_costs_prefer_the_plan_that_copies_less():
    workers, q, sched = setup()
    workers[0].queued_seconds = workers[2].queued_seconds = 0.0
    free = FetchingVertumnusRouter(kv_bytes_per_token=0)  # free copies: fetch == local on ties
    free.bind(sched)
    # Worker 0 holds 12 blocks, worker 1 could copy them for free: equal S and G, and worker
    # 0 wins every time, whatever the rotation.
    assert [free.choose(q, workers[:2], [12, 0], 0.0) for _ in range(4)] == [0, 0, 0, 0]


def test_bad_arguments_name_the_field():
    for bad in (-1, 1.9, float("inf"), True):
        with pytest.raises(ValueError, match="kv_bytes_per_token"):
            FetchingVertumnusRouter(bad)
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="transfer_gb_per_s"):
            FetchingVertumnusRouter(1, transfer_gb_per_s=bad)
    with pytest.raises(ValueError, match="beta"):
        FetchingVertumnusRouter(1, beta=-1)


def test_with_the_congestion_price_no_fetch_is_planned_while_every_queue_is_busy():
    workers, q, sched = setup()
    r = FetchingVertumnusRouter(kv_bytes_per_token=100_000, transfer_gb_per_s=1.0,
                                congestion_price=True)
    r.bind(sched)
    # No request queued anywhere (only worker 0's and 2's reserved seconds): the price is the
    # paper's lambda and the plans are those of the hand-computed case above.
    plans = r.plans(q, workers, [12, 0, 4], 0.0)
    assert [p[0] for p in plans] == pytest.approx([3.512, 3.584, 2.7528], abs=1e-12)
    assert [p[1:] for p in plans] == [(0, -1, 0), (12, 0, 12), (8, 0, 12)]
    # One request queued on every worker: lambda = 1 + 1 * 3 / 10 = 1.3 and nothing is fetched:
    # S = 0.512, 2.048, 3.072; C*S = 2.048, 8.192, 6.144 (cheapest 2.048);
    # cost = 3.512, 2.048 + 1.3 * 6.144 = 10.0352, 0.5 + 3.072 + 1.3 * 4.096 = 8.8968
    for w in workers:
        w.queue.append("queued")
    plans = r.plans(q, workers, [12, 0, 4], 0.0)
    assert [p[0] for p in plans] == pytest.approx([3.512, 10.0352, 8.8968], abs=1e-12)
    assert [p[1:] for p in plans] == [(0, -1, 0)] * 3
    assert r.choose(q, workers, [12, 0, 4], 0.0) == 0
    sched.dispatch(q, 0, 0.1)
    assert sched.fetched == [] and r.fetches.started == 0


def test_one_empty_queue_keeps_the_fetch_plans_and_a_rerouted_request_drops_its_plan():
    workers, q, sched = setup()
    r = FetchingVertumnusRouter(kv_bytes_per_token=100_000, transfer_gb_per_s=1.0,
                                congestion_price=True)
    r.bind(sched)
    # Workers 0 and 1 have a request queued, worker 2 none: some worker can take work at once,
    # the price is the paper's lambda and the plans are the hand-computed ones (fetches kept).
    workers[0].queue.append("queued")
    workers[1].queue.append("queued")
    plans = r.plans(q, workers, [12, 0, 4], 0.0)
    assert [p[0] for p in plans] == pytest.approx([3.512, 3.584, 2.7528], abs=1e-12)
    assert [p[1:] for p in plans] == [(0, -1, 0), (12, 0, 12), (8, 0, 12)]
    assert r.choose(q, workers, [12, 0, 4], 0.0) == 2  # with a fetch of 8 blocks
    # Routed again among workers 1 and 2 (worker 0 draining, say) once every queue is busy:
    # lambda = 1 + 1 * 2 / 6; costs 2.048 + (4 / 3) * (8.192 - 6.144) and 3.072, no fetch: worker
    # 2 again, and the earlier plan is dropped, so dispatching it there copies nothing.
    workers[2].queue.append("queued")
    workers[2].queued_seconds = 0.0
    plans = r.plans(q, workers[1:], [0, 4], 0.0)
    assert [p[0] for p in plans] == pytest.approx([2.048 + 4 / 3 * 2.048, 3.072], abs=1e-12)
    assert [p[1] for p in plans] == [0, 0]
    assert r.choose(q, workers[1:], [0, 4], 0.0) == 1
    sched.dispatch(q, 2, 0.1)
    assert sched.fetched == [] and r.fetches.started == 0


def test_plans_of_requests_that_never_start_are_forgotten():
    # Worker 0 holds 30 blocks of prompts a and b and has a long queue; worker 1 runs a short
    # prefill. b is placed on worker 1 with a fetch of its 30 blocks and stays queued. Then
    # copies of a are each placed there with a fetch and withdrawn while queued (a client that
    # went away): no dispatch pops their plans, so the plans are pruned to those of queued
    # requests, and b keeps its own.
    from serving.policy.backend import PrefillResult
    from serving.policy.scheduler import Scheduler

    class Backend:
        def __init__(self):
            self.copies = []

        def start_prefill(self, worker_id, request, now):
            pass

        def replicate(self, rep, now):
            self.copies.append((rep.src, rep.dst, rep.num_blocks, rep.request_id))

    backend = Backend()
    router = FetchingVertumnusRouter(kv_bytes_per_token=1, transfer_gb_per_s=1000.0,
                                     cost_model=LinearCost())
    s = Scheduler(layout_workers([1, 1], 1000, 1 << 20), LinearCost(), router, backend)
    a, b = chain_block_hashes(range(40)), chain_block_hashes(range(100, 140))
    s.prefix_index.insert(0, a[:30])
    s.prefix_index.insert(0, b[:30])
    for wid in (0, 1):
        s.submit(Request(f"busy{wid}", 0.0, 16, 1, chain_block_hashes([900 + wid]), 16), 0.0)
    assert s.workers[0].running.request_id == "busy0"
    s.workers[0].queued_seconds = 100.0
    assert s.submit(Request("b", 0.0, 40 * BS, 1, b, BS), 0.0) == 1
    for i in range(600):
        assert s.submit(Request(f"gone{i}", 0.0, 40 * BS, 1, a, BS), 0.0) == 1
        assert router.fetches._plans[f"gone{i}"] == (1, 30)
        assert s.abort(f"gone{i}", 0.0, "client disconnected")
    assert len(router.fetches._plans) <= 257 and router.fetches._plans["b"] == (1, 30)
    s.complete(1, "busy1", 0.1, PrefillResult(0, 0.1, 0.1, ()))  # b starts: its copy is made
    assert backend.copies == [(0, 1, 30, "b")] and router.fetches.started == 1
