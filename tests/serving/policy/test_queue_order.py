"""serving.policy.queue_order: which queued prefill a free worker starts (FCFS, SJF, HRRN,
gated SJF)."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.policy.backend import PrefillResult
from serving.policy.cost_router import VertumnusRouter
from serving.policy.placement import Placement
from serving.policy.queue_order import FCFS, SJF, QueueOrder, parse_queue_order
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import layout_workers
from tests.serving.policy.test_scheduler import Cost, RecordingBackend, req

HRRN = QueueOrder("hrrn")
GATED = QueueOrder("gated-sjf")
TOGETHER = (("A", 3000, 0.1), ("B", 1000, 0.1), ("C", 2000, 0.1))
SPREAD = (("A", 3000, 0.1), ("C", 2000, 0.2), ("B", 1000, 0.9))


def starts(backend):
    """(request id, start time) of each prefill started, in order."""
    return [(rid, now) for _, rid, now in backend.started]


def one_worker(order):
    backend, done = RecordingBackend(), []
    s = Scheduler(layout_workers([1], 100, 100_000), Cost(), VertumnusRouter(queue_order=order),
                  backend, done.append)
    return s, backend, done


def run_out(s, backend, times):
    """Completes whatever runs at each of `times` (seconds), in order."""
    for now in times:
        rid = starts(backend)[-1][0]
        s.complete(0, rid, now, PrefillResult(0, now, now))


@pytest.mark.parametrize("order, arrivals, expected", [
    # A (3 s), B (1 s), C (2 s) queued at 0.1 s behind R, which ends at 1 s.
    # FCFS: A 1 -> 4, B 4 -> 5, C 5 -> 7: TTFTs 3.9, 4.9, 6.9 s, mean 5.23 s.
    (FCFS, TOGETHER, [("R", 0.0), ("A", 1.0), ("B", 4.0), ("C", 5.0)]),
    # SJF: B 1 -> 2, C 2 -> 4, A 4 -> 7: TTFTs 1.9, 3.9, 6.9 s, mean 4.23 s.
    (SJF, TOGETHER, [("R", 0.0), ("B", 1.0), ("C", 2.0), ("A", 4.0)]),
    # A (3 s) arrives at 0.1, C (2 s) at 0.2, B (1 s) at 0.9. SJF: B 1 -> 2, C 2 -> 4, A 4 -> 7.
    (SJF, SPREAD, [("R", 0.0), ("B", 1.0), ("C", 2.0), ("A", 4.0)]),
    # HRRN at 1: waits over S are A 0.9 / 3 = 0.3, C 0.8 / 2 = 0.4, B 0.1 / 1 = 0.1: C, 1 -> 3.
    # At 3: A 2.9 / 3 = 0.97, B 2.1 / 1 = 2.1: B, 3 -> 4; then A, 4 -> 7.
    (HRRN, SPREAD, [("R", 0.0), ("C", 1.0), ("B", 3.0), ("A", 4.0)]),
    # Gated SJF, all three queued when R ends: one gate, SJF's order.
    (GATED, SPREAD, [("R", 0.0), ("B", 1.0), ("C", 2.0), ("A", 4.0)]),
])
def test_start_order_hand_computed(order, arrivals, expected):
    s, backend, done = one_worker(order)
    s.submit(req("R", 1000), 0.0)
    for rid, n, t in arrivals:
        s.submit(req(rid, n, t), t)
    assert s.workers[0].queued_seconds == pytest.approx(6.0)
    run_out(s, backend, [expected[1][1], expected[2][1], expected[3][1]])
    assert starts(backend) == expected
    # the reservation falls by each started request's own estimate, whatever the order
    assert s.workers[0].queued_seconds == 0.0 and len(done) == 3


def test_gated_sjf_lets_no_later_request_pass_the_gate():
    # R runs 0 -> 1. A (3 s) and C (2 s) are queued when it ends: the gate closes on them and
    # C starts (1 -> 3). B (1 s) arrives at 1.5, after the gate: A starts at 3 (SJF would start
    # B), then B at 6. TTFTs 2.9, 0.8, 4.5 s; SJF's 3.9, 0.8, 1.5.
    for order, expected in ((GATED, [("R", 0.0), ("C", 1.0), ("A", 3.0), ("B", 6.0)]),
                            (SJF, [("R", 0.0), ("C", 1.0), ("B", 3.0), ("A", 4.0)])):
        s, backend, done = one_worker(order)
        s.submit(req("R", 1000), 0.0)
        s.submit(req("A", 3000, 0.1), 0.1)
        s.submit(req("C", 2000, 0.2), 0.2)
        run_out(s, backend, [1.0])
        s.submit(req("B", 1000, 1.5), 1.5)
        run_out(s, backend, [expected[2][1], expected[3][1]])
        assert starts(backend) == expected, order.kind
        run_out(s, backend, [expected[3][1] + 1.0])
        assert len(done) == 4 and s.workers[0].queued_seconds == 0.0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.integers(1, 4), st.just(None)), min_size=1, max_size=24))
def test_gated_sjf_matches_a_reference_gate(ops):
    # ops: an int queues a request with that key, None starts one (if any is queued). The
    # reference keeps the gate as an explicit list of ids: when it is empty, every queued id
    # joins it; the least key of the gate starts, the first queued among equals.
    queue, placements, popped = deque(), {}, []
    ref_queue, gate, ref_popped = [], [], []
    for i, op in enumerate(ops):
        if op is not None:
            queue.append(req(i, 512, float(i)))
            placements[i] = Placement(None, float(op), 0, order_seconds=float(op))
            ref_queue.append(i)
        elif queue:
            popped.append(GATED.pop_next(queue, placements, 100.0).request_id)
            if not gate:
                gate = list(ref_queue)
            j = min(gate, key=lambda r: (ops[r], ref_queue.index(r)))
            gate.remove(j)
            ref_queue.remove(j)
            ref_popped.append(j)
    assert popped == ref_popped
    assert [r.request_id for r in queue] == ref_queue


def test_hrrn_equal_ratios_start_in_placement_order():
    q = deque([req("X", 2000, 0.0), req("Y", 1000, 0.5), req("Z", 1000, 0.5)])
    placements = {rid: Placement(None, s, 0, order_seconds=s)
                  for rid, s in (("X", 2.0), ("Y", 1.0), ("Z", 1.0))}
    # at 1.0: X 1.0 / 2 = 0.5, Y and Z 0.5 / 1 = 0.5: all equal, the first placed starts
    assert [HRRN.pop_next(q, placements, 1.0).request_id for _ in range(3)] == ["X", "Y", "Z"]


def test_sjf_does_not_start_a_request_before_the_one_computing_its_prefix():
    # P computes blocks 1-4; Q extends them by one block. Placed behind P, Q is predicted
    # 0.512 s (P's 2048 tokens promised), but ranked as if cold (2.56 s): P (2.048 s) starts
    # first, so Q finds its prefix. S (0.6 s) overtakes both.
    s, backend, _ = one_worker(SJF)
    s.submit(req("R", 1000), 0.0)
    s.submit(req("P", 2048, ids=[1, 2, 3, 4]), 0.1)
    s.submit(req("Q", 2560, ids=[1, 2, 3, 4, 5]), 0.2)
    s.submit(req("S", 600), 0.3)
    assert s._placements["Q"].estimate == pytest.approx(0.512)
    assert s._placements["Q"].order_seconds == pytest.approx(2.56)

    def finish(now):
        r = s.workers[0].running
        s.complete(0, r.request_id, now, PrefillResult(0, now, now, inserted_blocks=r.block_hashes))

    finish(1.0)  # R ends: S starts
    finish(1.6)  # S ends: P starts
    # T (1.0 s) arrives while P runs: shorter than Q as Q was ranked (2.56 s) ...
    s.submit(req("T", 1000), 2.0)
    finish(3.648)  # ... but P's end re-ranks Q at the prefix now held: 0.512 s, before T
    assert s._placements["Q"].order_seconds == pytest.approx(0.512)
    assert [rid for rid, _ in starts(backend)] == ["R", "S", "P", "Q"]
    finish(4.16)
    assert starts(backend)[-1] == ("T", 4.16)


def test_max_wait_starts_the_head_once_it_has_waited_too_long():
    order = QueueOrder("sjf", max_wait_s=2.0)
    s, backend, _ = one_worker(order)
    s.submit(req("R", 3000), 0.0)        # runs until 3.0
    s.submit(req("A", 4000, 0.5), 0.5)   # head of the queue, the longest
    s.submit(req("B", 1000, 0.6), 0.6)
    run_out(s, backend, [3.0])           # A has waited 2.5 s > 2 s: it starts before B
    assert starts(backend)[-1] == ("A", 3.0)
    s2, backend2, _ = one_worker(order)
    s2.submit(req("R", 1000), 0.0)       # ends at 1.0: A has waited 0.5 s, B goes first
    s2.submit(req("A", 4000, 0.5), 0.5)
    s2.submit(req("B", 1000, 0.6), 0.6)
    run_out(s2, backend2, [1.0])
    assert starts(backend2)[-1] == ("B", 1.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_sjf_pops_in_the_order_of_a_stable_sort(keys):
    queue = deque(req(i, 512, float(i)) for i in range(len(keys)))
    placements = {i: Placement(None, float(k), 0, order_seconds=float(k))
                  for i, k in enumerate(keys)}
    popped = [SJF.pop_next(queue, placements, 100.0).request_id for _ in range(len(keys))]
    assert popped == sorted(range(len(keys)), key=lambda i: keys[i])  # ties: placement order
    assert not queue


@pytest.mark.parametrize("spec, want", [
    ("fcfs", FCFS), ("sjf", SJF), ("sjf:30", QueueOrder("sjf", 30.0)),
    ("sjf:0.5", QueueOrder("sjf", 0.5)), ("hrrn", QueueOrder("hrrn")),
    ("gated-sjf", GATED),
])
def test_parse_queue_order(spec, want):
    assert parse_queue_order(spec) == want


@pytest.mark.parametrize("spec", ["", "lifo", "fcfs:3", "sjf:", "sjf:abc", "sjf:0", "sjf:-1",
                                  "sjf:inf", "sjf:nan", "hrrn:5", "gated-sjf:5"])
def test_parse_queue_order_refuses(spec):
    with pytest.raises(ValueError, match="queue_order="):
        parse_queue_order(spec)


@pytest.mark.parametrize("kw, match", [
    (dict(kind="lifo"), "kind must be one of"),
    (dict(kind="fcfs", max_wait_s=5.0), "'fcfs' takes None"),
    (dict(kind="hrrn", max_wait_s=5.0), "'hrrn' takes None"),
    (dict(kind="gated-sjf", max_wait_s=5.0), "'gated-sjf' takes None"),
    (dict(kind="sjf", max_wait_s=True), "max_wait_s must be"),
    (dict(kind="sjf", max_wait_s=0.0), "max_wait_s must be"),
    (dict(kind="sjf", max_wait_s="5"), "max_wait_s must be"),
])
def test_queue_order_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        QueueOrder(**kw)


def test_router_refuses_a_queue_order_that_is_not_one():
    with pytest.raises(ValueError, match="queue_order must be a QueueOrder"):
        VertumnusRouter(queue_order="sjf")


def test_scheduler_refuses_a_router_queue_order_that_is_not_one():
    class Plugin(LeastWorkRouter):
        queue_order = "sjf"  # a plug-in's attribute of that name, but not a QueueOrder

    with pytest.raises(ValueError, match="router.queue_order must be a QueueOrder"):
        Scheduler(layout_workers([1], 100, 100_000), Cost(), Plugin(), RecordingBackend())


def test_numpy_numbers_and_blanks_are_taken():
    assert QueueOrder("sjf", np.int64(2)).max_wait_s == 2
    assert parse_queue_order(" sjf:30 ") == QueueOrder("sjf", 30.0)
