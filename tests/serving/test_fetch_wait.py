"""`FetchWaits`: a prefill is held exactly while the copy made for it to its worker is in
flight, and starts when the copy ends or a worker of the copy is lost (hand-built cases)."""

from __future__ import annotations

from serving.fetch_wait import FetchWaits
from serving.policy.replication import Replication


def _rep(src, dst, request_id="r", chain=(11, 12, 13)):
    reason = "request-transfer" if request_id is not None else "inter-degree"
    return Replication(src, dst, chain, 0, 16, 0.0, reason, request_id)


def test_held_until_its_copy_ends():
    waits, started = FetchWaits(), []
    rep = _rep(0, 1)
    waits.copy_started(rep)
    assert not waits.hold(2, "r", lambda: started.append("other"))  # another worker: not held
    assert not waits.hold(1, "q", lambda: started.append("q"))  # no copy for that request
    assert waits.hold(1, "r", lambda: started.append("r"))
    assert len(waits) == 1 and started == []
    waits.copy_ended(_rep(0, 1))  # an equal copy, not this one (a stale report): ignored
    assert started == []
    waits.copy_ended(rep)
    assert started == ["r"] and len(waits) == 0 and waits.started == 1
    waits.copy_ended(rep)  # ended twice: nothing more
    assert started == ["r"]


def test_a_copy_that_ended_first_holds_nothing():
    waits, started = FetchWaits(), []
    rep = _rep(0, 1)
    waits.copy_started(rep)
    waits.copy_ended(rep)
    assert not waits.hold(1, "r", lambda: started.append("r"))
    assert started == [] and waits.started == 0


def test_copies_not_made_for_a_request_hold_nothing():
    waits, started = FetchWaits(), []
    rep = _rep(0, 1, request_id=None)
    waits.copy_started(rep)
    assert not waits.hold(1, None, lambda: started.append("x"))
    waits.copy_ended(rep)
    assert started == [] and len(waits) == 0


def test_a_lost_worker_ends_its_copies():
    waits, started = FetchWaits(), []
    from_lost, to_lost, elsewhere = _rep(5, 1, "a"), _rep(0, 5, "b"), _rep(0, 2, "c")
    for rep in (from_lost, to_lost, elsewhere):
        waits.copy_started(rep)
        assert waits.hold(rep.dst, rep.request_id, lambda r=rep: started.append(r.request_id))
    waits.workers_lost([5])
    # the prefill whose source left starts on its local prefix; the one on the lost worker is
    # dropped (the scheduler failed it); the copy between two live workers still holds its own
    assert started == ["a"] and (waits.started, waits.dropped) == (1, 1)
    assert len(waits) == 1
    waits.copy_ended(to_lost)  # a late report of a forgotten copy: nothing
    assert started == ["a"]
    waits.copy_ended(elsewhere)
    assert started == ["a", "c"] and len(waits) == 0
