"""A request's placement on a worker, as the scheduler keeps it until the request ends."""

from __future__ import annotations

import dataclasses

from serving.policy.prefix_index import PendingPrefixes
from serving.policy.request import Request
from serving.policy.worker import WorkerState


@dataclasses.dataclass(slots=True)
class Placement:
    """Where a queued or running request was placed, and what was predicted for it.

    Attributes:
      worker: the worker it was placed on.
      estimate: predicted prefill seconds, reserved on the worker (`WorkerState.queued_seconds`).
      predicted_cached_len: tokens the router expected cached on the worker when it starts
        (prefixes promised by prefills queued before it included).
      global_cached_len: tokens of its prefix held by some worker of the pool (with a
        `GlobalPrefixTrie`; else 0).
      start_time: when its prefill started (seconds); None while queued.
      order_seconds: the queue order's key (`serving.policy.queue_order`: "sjf", "gated-sjf",
        the S of "hrrn"'s ratio): predicted prefill seconds at the prefix the worker held at
        placement, without promised blocks.
      gated: within its worker's current gate ("gated-sjf": `queue_order.gate_length`).
    """

    worker: WorkerState
    estimate: float
    predicted_cached_len: int
    global_cached_len: int = 0
    start_time: float | None = None
    order_seconds: float = 0.0
    gated: bool = False


def withdraw_queued(placements: dict[str | int, Placement], request_id: str | int,
                    pending: PendingPrefixes | None) -> Request | None:
    """Takes the queued (not started) request `request_id` off its worker's queue: its
    reservation, its entry in `placements` and (with `pending`) the blocks its prefill promised
    are released. Returns it; None, changing nothing, when it is running (`Scheduler.abort`).

    Raises:
      KeyError: `request_id` has no placement.
    """
    placement = placements[request_id]
    worker = placement.worker
    request = next((r for r in worker.queue if r.request_id == request_id), None)
    if request is None:
        return None
    worker.queue.remove(request)
    worker.queued_seconds = (max(0.0, worker.queued_seconds - placement.estimate)
                             if worker.queue else 0.0)
    del placements[request_id]
    if pending is not None:
        pending.remove(worker.worker_id, request.block_hashes[:request.full_blocks])
    return request
