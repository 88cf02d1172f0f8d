"""The event-driven scheduler core shared by the live and the simulated backends.

`Scheduler` owns the workers' queues (started in the router's `queue_order`, FIFO by default)
and reservations, driven by these calls, each given `now` in seconds (it never reads a clock):

- `submit(request, now)`: route to one eligible worker, reserve the predicted prefill time on
  it at once, start it if the worker is idle;
- `complete(worker_id, request_id, now, result)`: the backend finished a prefill; apply its KV
  events to the prefix index, release the reservation, report it, start the worker's next one;
- `fail(worker_id, request_id, now, error)`: the backend could not run a prefill;
- `abort(request_id, now, reason)`: withdraw a request that has not started;
- `tick(now)`: periodic hooks (the controller and prefix-cache manager plug in here);
- `lose_workers(ids, now, reason)` / `add_workers(specs, now)`: a host died / came back.

Collaborators own the rest: `reconfig` (`Reconfigurations`: epochs, fresh worker ids, splits
and merges in progress), `copies` (`PrefixCopies`: copies, reclamations) and `membership`
(`Membership`: workers lost and added, requests withdrawn or placed again);
`begin_/finish_reconfiguration` (`serving.policy.split_merge`, mixed in) touch the queues (the
latter then runs `reconfigured_hooks`: a controller waiting for the change evaluates at once).

Invariant (DESIGN.md, "Request path"): every submitted request ends in exactly one
`RequestRecord` given to the listener, completed, failed with an explicit error, or aborted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from serving.policy.backend import Backend, CostModel, PrefillResult
from serving.policy.eligibility import eligible_workers
from serving.policy.membership import LostWorkers, Membership
from serving.policy.placement import Placement
from serving.policy.prefix_index import PendingPrefixes, PrefixIndex
from serving.policy.queue_order import FCFS, QueueOrder, rekey_promised
from serving.policy.reconfiguration import Reconfigurations
from serving.policy.replication import PrefixCopies
from serving.policy.request import Request, RequestRecord
from serving.policy.router import Router
from serving.policy.split_merge import SplitMerge
from serving.policy.worker import WorkerSpec, WorkerState, WorkerStatus


class Scheduler(SplitMerge):
    """Routes requests to workers and keeps their queues; see the module docstring.

    Args:
      workers: the pool's initial workers (unique ids).
      cost_model: predicts prefill seconds for (cp_degree, input_len, cached_len).
      router: picks a worker among the eligible ones.
      backend: runs prefills (`Backend`).
      listener: called once per finished request with its `RequestRecord`, while the
        scheduler's state is mid-change: it must not raise nor call back into the scheduler
        (the engine's keeps its hooks' errors from it).
      prefix_index: the cluster's block-holder index (a fresh one by default).
      log_limit: finished operations the logs of `reconfig` and `copies` keep (None: all).

    Raises:
      ValueError: duplicate worker ids, an empty pool, or a router `queue_order` not a `QueueOrder`.
    """

    def __init__(self, workers: Sequence[WorkerSpec], cost_model: CostModel, router: Router,
                 backend: Backend, listener: Callable[[RequestRecord], None] | None = None,
                 prefix_index: PrefixIndex | None = None, log_limit: int | None = None) -> None:
        if not workers:
            raise ValueError("workers must name at least one worker")
        ids = [w.worker_id for w in workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        self.cost_model, self.router, self._backend = cost_model, router, backend
        self.listener = listener or (lambda record: None)
        self._prefix_index = prefix_index if prefix_index is not None else PrefixIndex()
        # Blocks promised by queued and running prefills, for routers that ask for them.
        self.pending = PendingPrefixes()
        # the index's `record` (demand statistics of a `GlobalPrefixTrie`), looked up once
        self._record: Callable[..., None] | None = getattr(self._prefix_index, "record", None)
        self.reconfig = Reconfigurations(max(ids) + 1, log_limit)
        self._workers: dict[int, WorkerState] = {}
        for spec in sorted(workers, key=lambda s: s.worker_id):
            self.workers[spec.worker_id] = WorkerState(spec, epoch=self.reconfig.epoch)
            self.prefix_index.register_worker(spec.worker_id, spec.cp_degree)
        self.tick_hooks: list[Callable[[Scheduler, float], None]] = []
        self.submit_hooks: list[Callable[[Request, float], None]] = []
        # (request, expected cached tokens, now) after each placement
        self.placement_hooks: list[Callable[[Request, int, float], None]] = []
        # (request, worker id, now) as a request leaves its queue, before its prefill starts
        self.dispatch_hooks: list[Callable[[Request, int, float], None]] = []
        self.refused_hooks: list[Callable[[Request, float], None]] = []  # none can hold it
        self.reconfigured_hooks: list[Callable[[Scheduler, float], None]] = []  # a change done
        self.rerouted: set[str | int] = set()  # ids taken off a queue to be placed again
        self.rerouting = False  # True while placement hooks see one placed (no new arrival)
        self.copies = PrefixCopies(self.workers, self.prefix_index, backend, log_limit)
        self.membership = Membership(self)
        self._placements: dict[str | int, Placement] = {}
        self._pending: deque[Request] = deque()
        self.num_submitted = self.num_completed = self.num_failed = self.num_aborted = 0
        # While the router chooses: (request, candidates, their cached blocks without promises)
        self.routing: tuple[Request, list[WorkerState], list[int]] | None = None
        bind = getattr(router, "bind", None)
        if bind is not None:  # routers that need the cost model, the index or the hooks
            bind(self)
        self._use_pending = bool(getattr(router, "uses_pending_prefixes", False))
        self.queue_order: QueueOrder = getattr(router, "queue_order", FCFS)
        if not isinstance(self.queue_order, QueueOrder):
            raise ValueError(f"router.queue_order must be a QueueOrder, got {self.queue_order!r}")

    # ----------------------------------------------------------------------------- queries
    @property
    def workers(self) -> dict[int, WorkerState]:
        """The pool's workers by id (changed in place: `copies` and the backends hold it)."""
        return self._workers

    @property
    def prefix_index(self) -> PrefixIndex:
        """The cluster's block-holder index, fixed at construction (`copies` reads it too)."""
        return self._prefix_index

    @property
    def backend(self) -> Backend:
        """The backend that runs prefills, copies and re-carves, fixed at construction."""
        return self._backend

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended (queued, running or pending)."""
        return self.num_submitted - self.num_completed - self.num_failed - self.num_aborted

    def eligible(self, request: Request) -> tuple[list[WorkerState], list[int]]:
        """ACTIVE workers able to hold `request`, and per worker its matched leading blocks (a
        cache miss never excludes a worker; only status, length and KV capacity do)."""
        return eligible_workers(self.workers.values(), self.prefix_index,
                                self.pending if self._use_pending else None, request, False)[:2]

    # ----------------------------------------------------------------------------- events
    def submit(self, request: Request, now: float) -> int | None:
        """Routes `request` and reserves its predicted prefill time on the chosen worker.

        Returns:
          The chosen worker id; None when the request waits for a worker (every one that could
          hold it is draining or unavailable) or failed as none can (the listener has it).

        Raises:
          ValueError: `request.request_id` is already in flight.
          Exception: a submit hook's, the router's or the cost model's: the request was not
            taken (nothing changed). A placement or refused hook's error comes after the request
            was taken (placed and runs, or failed as no worker holds it): it is kept in
            `membership.errors` and not raised, so a caller never drops a request that runs.
        """
        rid = request.request_id
        if rid in self._placements or ((self._pending or self.membership.placing)
                                       and self.membership.waiting(rid)):
            raise ValueError(f"request_id {rid!r} is already in flight")
        for hook in self.submit_hooks:
            hook(request, now)
        self.num_submitted += 1
        ended = self.membership.num_ended()
        try:
            return self._route(request, now)
        except Exception as e:
            if not self.membership.taken(request, ended):  # a router or cost-model error
                self.num_submitted -= 1
                raise
            self.membership.error(request, now, e)  # a hook's, after the request was taken
            return self._placed_on(rid)

    def complete(self, worker_id: int, request_id: str | int, now: float,
                 result: PrefillResult) -> None:
        """The backend finished `request_id` on `worker_id` at `now` (a late report for a
        worker lost meanwhile is ignored: `lose_workers` failed the request).

        Raises:
          ValueError: the worker is not running that request (a protocol error of the backend).
        """
        if worker_id in self.membership.lost:
            return
        worker, placement, request = self._take_running(worker_id, request_id)
        index = self._prefix_index
        if result.evicted_blocks:
            index.evict(worker_id, result.evicted_blocks)
        if result.inserted_blocks:
            index.insert(worker_id, result.inserted_blocks)
            if self.queue_order.reorders and worker.queue:
                rekey_promised(worker, self._placements, index, self.cost_model.predict)
        self.num_completed += 1
        self.listener(RequestRecord(
            request, worker_id, worker.spec.cp_degree, worker.epoch,
            placement.start_time, result.finish_time, result.first_token_time, result.cached_len,
            placement.predicted_cached_len, placement.estimate, None, result.first_token,
            placement.global_cached_len))
        self._after_run(worker, now)

    def kv_events(self, worker_id: int, inserted: Sequence[int], evicted: Sequence[int]) -> None:
        """A worker's prefix cache changed outside a completion (blocks evicted when a prefill
        starts): applies the events to the prefix index, evictions first."""
        if worker_id not in self._workers:
            return  # the worker left the pool; its blocks went with it
        if evicted:
            self._prefix_index.evict(worker_id, evicted)
        if inserted:
            self._prefix_index.insert(worker_id, inserted)

    def fail(self, worker_id: int, request_id: str | int, now: float, error: str,
             retryable: bool = False) -> None:
        """The backend could not prefill `request_id` on `worker_id`: it fails (its record has
        `error`, and `retryable` when another attempt may succeed) and the worker starts its
        next one (a late report for a lost worker is ignored).

        Raises:
          ValueError: the worker is not running that request.
        """
        if worker_id in self.membership.lost:
            return
        self._after_run(self._fail_running(worker_id, request_id, now, error, retryable), now)

    def abort(self, request_id: str | int, now: float, reason: str) -> bool:
        """Withdraws `request_id` if it has not started (queued on a worker, or waiting for
        one), as vLLM aborts a request whose client disconnected; a running prefill is never
        dropped. The listener gets its record (`aborted=True`, `error=reason`).

        Returns:
          True when the request was withdrawn; False when it is running or not in flight.
        """
        return self.membership.withdraw(request_id, now, reason)

    def tick(self, now: float) -> None:
        """Runs the periodic hooks, then retries requests waiting for a worker (also when a
        hook raised: the hooks after it are skipped this tick, and its error comes out)."""
        try:
            for hook in self.tick_hooks:
                hook(self, now)
        finally:  # (a hook's error comes out after the retry)
            self._retry_pending(now)

    # ----------------------------------------------------------------------------- hosts
    def lose_workers(self, worker_ids: Sequence[int], now: float, reason: str) -> LostWorkers:
        """A host died: `Membership.lose` (returns `LostWorkers`; ValueError: unknown ids)."""
        return self.membership.lose(worker_ids, now, reason)

    def add_workers(self, specs: Sequence[WorkerSpec], now: float) -> list[WorkerState]:
        """New workers (ids from `new_worker_ids`) join ACTIVE (`Membership.add`)."""
        return self.membership.add(specs, now)

    # ----------------------------------------------------------------------------- internals
    def _route(self, request: Request, now: float) -> int | None:
        record, workers = self._record, self._workers
        candidates, matched, global_blocks, held = eligible_workers(
            workers.values(), self._prefix_index, self.pending if self._use_pending else None,
            request, record is not None)
        if not candidates:
            if any(w.can_hold(request) for w in workers.values()) or \
                    self.reconfig.will_hold(request):
                self._pending.append(request)  # a draining worker or one being re-carved
                return None
            largest = max((w.spec.max_input_len for w in workers.values()), default=0)
            self._fail_unplaced(request, now, (
                f"input_len={request.input_len} tokens cannot be held by any worker "
                f"(max_input_len <= {largest} tokens, or not enough KV blocks)"))
            return None
        self.routing = (request, candidates, held)  # for the router, during `choose` only
        try:
            i = self.router.choose(request, candidates, matched, now)
        finally:
            self.routing = None
        worker, bs, m = candidates[i], request.block_size, matched[i]
        spec, cached = worker.spec, m * bs
        estimate = self.cost_model.predict(spec.cp_degree, request.input_len, cached)
        placement = Placement(worker, estimate, cached)
        if self.queue_order.reorders:  # SJF key: the prefix held now, without promises
            placement.order_seconds = estimate if held[i] == m else self.cost_model.predict(
                spec.cp_degree, request.input_len, held[i] * bs)
        if record is not None:  # the global trie keeps demand statistics
            g = max(global_blocks, m)
            record(request, spec.cp_degree, g, m)
            placement.global_cached_len = g * bs
        self._placements[request.request_id] = placement
        if self._use_pending:
            self.pending.add(spec.worker_id, request.block_hashes[:request.input_len // bs])
        worker.queue.append(request)
        worker.queued_seconds += estimate
        outer, self.rerouting = self.rerouting, request.request_id in self.rerouted
        try:
            for hook in self.placement_hooks:
                hook(request, cached, now)
        finally:  # (a hook may place another request: the flag is restored, not cleared)
            self.rerouting = outer
            self.rerouted.discard(request.request_id)
            if worker.running is None:  # (placed: it starts even if a hook raised)
                self._dispatch(worker, now)
        return self._placed_on(request.request_id)  # (a hook may have moved or ended it)

    def _placed_on(self, request_id: str | int) -> int | None:
        placement = self._placements.get(request_id)
        return placement.worker.worker_id if placement is not None else None

    def _dispatch(self, worker: WorkerState, now: float) -> None:
        while worker.running is None and worker.queue:  # (again if one fails to start)
            request = self.queue_order.pop_next(worker.queue, self._placements, now)
            placement = self._placements[request.request_id]
            estimate, placement.start_time = placement.estimate, now
            worker.queued_seconds = worker.queued_seconds - estimate if worker.queue else 0.0
            worker.running, worker.running_start, worker.running_estimate = request, now, estimate
            try:
                for hook in self.dispatch_hooks:
                    hook(request, worker.spec.worker_id, now)
                if worker.running is request and worker.worker_id not in self.membership.lost:
                    self._backend.start_prefill(worker.spec.worker_id, request, now)
            except Exception as e:  # noqa: BLE001 (it fails; the error kept in membership.errors)
                self.membership.error(request, now, e)
                if worker.worker_id not in self.membership.lost:  # (a hook lost it: failed)
                    self._fail_running(worker.worker_id, request.request_id, now,
                                       f"dispatch failed: {type(e).__name__}: {e}")
                    if worker.status is WorkerStatus.DRAINING:  # (a hook began a change)
                        self._recarve_drained(worker, now)

    def _fail_running(self, worker_id: int, request_id: str | int, now: float, error: str,
                      retryable: bool = False) -> WorkerState:
        worker, placement, request = self._take_running(worker_id, request_id)
        self.num_failed += 1
        self.listener(RequestRecord(
            request, worker_id, worker.cp_degree, worker.epoch,
            placement.start_time, now, None, 0, placement.predicted_cached_len,
            placement.estimate, error, None, placement.global_cached_len, retryable=retryable))
        worker.running, worker.running_estimate = None, 0.0
        return worker

    def _take_running(self, worker_id: int,
                      request_id: str | int) -> tuple[WorkerState, Placement, Request]:
        worker = self._workers.get(worker_id)
        if worker is None or worker.running is None or worker.running.request_id != request_id:
            raise ValueError(f"worker {worker_id} is not running request {request_id!r}")
        request = worker.running
        if self._use_pending:
            self.pending.remove(worker_id, request.block_hashes[:request.full_blocks])
        return worker, self._placements.pop(request_id), request

    def _after_run(self, worker: WorkerState, now: float) -> None:
        worker.running, worker.running_estimate = None, 0.0
        if worker.status is WorkerStatus.DRAINING:
            self._recarve_drained(worker, now)
            return
        self._dispatch(worker, now)

    def _fail_unplaced(self, request: Request, now: float, error: str) -> None:
        self.num_failed += 1
        self.rerouted.discard(request.request_id)
        self.listener(RequestRecord(request, finish_time=now, error=error))
        for hook in self.refused_hooks:
            hook(request, now)

    def _retry_pending(self, now: float) -> None:
        waiting = list(self._pending)
        self._pending.clear()  # (in place: a loss in progress holds this deque)
        self.membership.place_again(waiting, now)  # (errors: `membership.errors`)
