"""Prefills held until the prefix copy made for them lands (a router's per-request fetch).

A router that fetches a prefix for a request (`serving.policy.fetch_router`, Mooncake's
Conductor in `serving.baselines.mooncake`) prices TTFT = queue + transfer + prefill: the
prefill starts once the copied blocks are there. `serving.policy.replication.FetchOnDispatch`
starts the copy (reason "request-transfer") in the scheduler's dispatch hook, just before the
scheduler asks the backend to start the request's prefill, which must then wait for the copy.

The simulator (`eval.sim.backend.SimulatedBackend`) and the multi-host
`serving.ray_backend.RayBackend` hold the prefill here, by one rule: it starts when the copy
ends, landed or not (a failed copy leaves the request on its local prefix), or when a worker
of the copy is lost (the copy never lands; the prefill of a request whose own worker was lost
is dropped: `Scheduler.lose_workers` failed it). On Ray this is needed because an async host
agent runs its calls concurrently, and a copy across hosts is an export on one agent then an
import on the other, so the prefill reached the destination first and recomputed the prefix.
The single-host `serving.live_backend.LiveBackend` holds it by construction: the copy runs on
the destination worker's one-thread executor, submitted before the prefill.

Plain data, called on the scheduler's thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class FetchWaits:
    """The copies made for requests that are in flight, and the prefills held behind them.

    Attributes:
      started: prefills started at the end of their copy (or of a worker of it).
      dropped: prefills dropped because their own worker was lost.
    """

    def __init__(self) -> None:
        self._copies: dict = {}  # request id -> the `Replication` in flight for it
        self._held: dict = {}  # request id -> (worker id, start)
        self.started = self.dropped = 0

    def __len__(self) -> int:
        """Prefills held now."""
        return len(self._held)

    def copy_started(self, replication) -> None:
        """A copy began (`Backend.replicate`); one made for a request (`request_id` set) holds
        that request's prefill on its destination until `copy_ended`."""
        if replication.request_id is not None:
            self._copies[replication.request_id] = replication

    def hold(self, worker_id: int, request_id, start: Callable[[], None]) -> bool:
        """Holds the prefill of `request_id` on `worker_id` when a copy to that worker is in
        flight for it: `start()` is called when the copy ends (`copy_ended`) or a worker of it
        is lost (`workers_lost`; not called when `worker_id` itself is). Returns whether it
        was held (False: start it now)."""
        rep = self._copies.get(request_id)
        if rep is None or rep.dst != worker_id:
            return False
        self._held[request_id] = (worker_id, start)
        return True

    def copy_ended(self, replication) -> None:
        """A copy ended, landed or failed (call it after the scheduler heard of the copy, so
        the held prefill sees the blocks in the prefix index): starts the prefill held behind
        it. Copies not made for a request, and copies already ended, are ignored."""
        rid = replication.request_id
        if rid is None or self._copies.get(rid) is not replication:
            return
        del self._copies[rid]
        held = self._held.pop(rid, None)
        if held is not None:
            self.started += 1
            held[1]()

    def workers_lost(self, worker_ids: Iterable[int]) -> None:
        """Workers left the pool with their host: a copy from or to one of them never ends.
        Prefills held on a worker still there start now (on their local prefix); those held on
        a lost worker are dropped (the scheduler failed their requests)."""
        gone = set(worker_ids)
        for rid, rep in list(self._copies.items()):
            if rep.src not in gone and rep.dst not in gone:
                continue
            del self._copies[rid]
            held = self._held.pop(rid, None)
            if held is None:
                continue
            if held[0] in gone:
                self.dropped += 1
            else:
                self.started += 1
                held[1]()
