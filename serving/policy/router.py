"""Request-level routing: pick one worker for each request.

A router sees the eligible workers (ACTIVE, able to hold the request) and, for each, how many
leading blocks of the request that worker holds, and returns one of them. The scheduler then
reserves the predicted prefill time on the chosen worker at once, so requests that arrive in
the same instant see each other's load.

Routers here are plain Python over plain data; they never read a clock (`now` is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from serving.policy.request import Request
from serving.policy.worker import WorkerState


class Router(Protocol):
    """A routing policy.

    A router may also define `bind(scheduler)`: the `Scheduler` calls it once at construction,
    so a router can keep references to `scheduler.cost_model` and `scheduler.prefix_index`
    (the cluster-wide view of cached blocks). A router instance serves one scheduler. It may
    define `queue_order` (a `serving.policy.queue_order.QueueOrder`): the order in which the
    scheduler starts each worker's queued prefills (FCFS when absent).
    """

    name: str

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        """Returns the index into `candidates` of the worker for `request`.

        Args:
          request: the request to place.
          candidates: eligible workers (non-empty), in worker-id order.
          matched_blocks: per candidate, the leading blocks of the request it holds.
          now: current time in seconds.
        """
        ...


class LeastWorkRouter:
    """Least outstanding work: the worker with the smallest predicted queueing delay `Q_w`.

    Ties (equal `Q_w`, e.g. an idle pool) go round-robin: the scan starts one worker further
    each call, so ties are broken deterministically without a bias toward worker 0. This is
    the "least-loaded" policy of SGLang's router and vLLM production-stack's session-free
    routing, with load measured in predicted seconds rather than request counts.
    """

    name = "least-work"

    def __init__(self) -> None:
        self._rotation = 0

    def choose(self, request: Request, candidates: Sequence[WorkerState],
               matched_blocks: Sequence[int], now: float) -> int:
        n = len(candidates)
        start = self._rotation % n
        self._rotation += 1
        best, best_q = -1, float("inf")
        for i in (*range(start, n), *range(start)):
            w = candidates[i]
            q = w.queued_seconds  # inline of WorkerState.outstanding_seconds (hot path)
            if w.running is not None:
                q += max(0.0, w.running_estimate - (now - w.running_start))
            if q < best_q:
                best, best_q = i, q
        return best
