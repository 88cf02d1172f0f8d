"""Discrete-event simulation of the prefill pool, driving the same `serving.Scheduler` that serves.

The simulated backend charges each prefill the ground-truth time of a profile table
(`eval.sim.ground_truth.GroundTruthProfile`, optionally noisy) for the hit its worker's local LRU
cache actually gives, while the router only sees the fitted cost model and the prefix index
built from KV events, so the router is never omniscient (DESIGN.md, "One policy core, two
backends"). TTFT adds the KV transfer to the decode pool and one decode step, as the paper
counts TTFT for a disaggregated prefill pool.

Events are (time, sequence, kind, payload) on a heap; arrivals are merged from the sorted
request list (open loop) or made during the run by an `ArrivalSource` (closed loop: a session's
next request is an event created when its previous request completes); ties are ordered
completions first, then backend callbacks (copies, re-carves), then arrivals, then ticks, then
by sequence.

Hosts (issue 19): with `SimConfig.gpus_per_host` the workers are placed on hosts of that many
GPUs (a worker never spans two), copies across hosts run at the scale-out bandwidth, and
`SimConfig.host_failures` makes hosts fail (and come back) during the run.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Protocol

from eval.sim.backend import SimConfig, SimulatedBackend  # noqa: F401 (SimConfig re-exported)
from serving.policy.prefix_index import PrefixIndex
from serving.policy.request import Request, RequestRecord
from serving.policy.router import Router
from serving.policy.scheduler import CostModel, Scheduler
from serving.policy.worker import WorkerSpec, assign_hosts

_COMPLETE, _CALL, _ARRIVAL, _TICK = 0, 1, 2, 3


def intern_block_hashes(requests: Sequence[Request]) -> list[Request]:
    """The requests with their block hashes renumbered 1..N in the order of the hash values.

    Equal hashes stay equal, distinct ones distinct, and their order is kept (the prefix-cache
    manager scans prefix tips in hash order), so a replay's results are unchanged; but small
    ints hash in one step where 64-bit ones take several, and the simulated workers' caches and
    the policy's indexes look blocks up tens of times per request. Done once per workload
    (`eval.experiment.run_sweep`, `eval.bench_sim`), not per simulation.

    Returns:
      New `Request`s, in the input order (the input is not modified).
    """
    distinct = sorted({h for r in requests for h in r.block_hashes})
    dense = dict(zip(distinct, range(1, len(distinct) + 1))).__getitem__
    return [dataclasses.replace(r, block_hashes=tuple(map(dense, r.block_hashes)))
            for r in requests]


class ArrivalSource(Protocol):
    """Arrivals made during a run (closed loop); `eval.traces.sessions.ClosedLoop` is one."""

    def start(self) -> list[tuple[float, Request]]:
        """The first arrivals, `(time, request)`, sorted by time."""

    def on_record(self, record: RequestRecord) -> list[tuple[float, Request]]:
        """The arrivals made by a request's end (its `RequestRecord`), at or after its end."""


MAX_TIME_S = 1e11  # keeps t + tick_interval > t in float64 for ticks >= 1 ms


def simulate(requests: Sequence[Request], workers: Sequence[WorkerSpec], cost_model: CostModel,
             router: Router, prefill_seconds: Callable[[int, int, int], float],
             config: SimConfig = SimConfig(),
             tick_hooks: Sequence[Callable[[Scheduler, float], None]] = (),
             setup: Sequence[Callable[[Scheduler], None]] = (),
             prefix_index: PrefixIndex | None = None,
             arrivals: ArrivalSource | None = None) -> list[RequestRecord]:
    """Replays `requests` (sorted by arrival) through a simulated pool.

    Args:
      requests: the workload, sorted by `arrival_time` (seconds); open loop.
      workers: initial pool composition.
      cost_model: the router's estimate of prefill seconds (fitted, not the ground truth).
      router: routing policy.
      prefill_seconds: ground-truth prefill seconds `(cp_degree, input_len, cached_len)`.
      config: `SimConfig`.
      tick_hooks: periodic hooks `(scheduler, now)`, run every `config.tick_interval` seconds.
      setup: called with the `Scheduler` before the run (attach a controller, keep a handle to
        read its logs afterwards).
      prefix_index: the scheduler's index of cached blocks (`PrefixIndex` by default; a
        `GlobalPrefixTrie` for the prefix-cache manager).
      arrivals: a closed-loop source of further arrivals (with `requests` empty, the whole
        workload): its `start()` at the beginning, its `on_record(record)` after each request
        ends; each arrival becomes an event of the run.

    Returns:
      One `RequestRecord` per request, in completion order.

    Raises:
      ValueError: requests not sorted by arrival time, or a worker that would span hosts of
        `config.gpus_per_host` GPUs (`--gpus_per_host`).
      RuntimeError: the run ended with requests still in flight (a scheduler bug), or errors
        of the router, a hook or the backend were kept instead of raised while it ran
        (`Membership.errors`: the service goes on, a simulation must not: its results would
        not be the policy's).
    """
    if requests and requests[-1].arrival_time > MAX_TIME_S:
        raise ValueError(f"arrival times must be <= {MAX_TIME_S:g} s (about 3,000 years); the last "
                         f"request arrives at {requests[-1].arrival_time:g} s (a request rate far "
                         "too low?)")
    for a, b in zip(requests, requests[1:]):
        if b.arrival_time < a.arrival_time:
            raise ValueError(f"requests must be sorted by arrival_time; {b.request_id!r} at "
                             f"{b.arrival_time} follows {a.request_id!r} at {a.arrival_time}")
    records: list[RequestRecord] = []
    heap: list = []
    seq = 0

    def push_completion(t: float, payload: tuple) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, _COMPLETE, seq, payload))

    def push_call(t: float, fn: Callable[[], None]) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, _CALL, seq, fn))

    queued = [0]  # arrival events on the heap
    if arrivals is None:
        listener = records.append
    else:
        def push_arrivals(batch: list[tuple[float, Request]]) -> None:
            nonlocal seq
            for t, request in batch:
                if not t <= MAX_TIME_S:
                    raise ValueError(f"arrival time {t} s of {request.request_id!r} is beyond "
                                     f"{MAX_TIME_S:g} s or not finite")
                seq += 1
                queued[0] += 1
                heapq.heappush(heap, (t, _ARRIVAL, seq, request))

        def listener(record: RequestRecord) -> None:
            records.append(record)
            push_arrivals(arrivals.on_record(record))

    if config.gpus_per_host:
        try:
            workers = assign_hosts(workers, config.gpus_per_host)
        except ValueError as e:
            raise ValueError(f"--gpus_per_host={config.gpus_per_host}: {e} (give CP degrees "
                             f"that divide --gpus_per_host)") from None
    backend = SimulatedBackend(workers, prefill_seconds, config, push_completion, push_call)
    scheduler = Scheduler(workers, cost_model, router, backend, listener=listener,
                          prefix_index=prefix_index)
    backend.scheduler = scheduler
    backend.share_caches()
    scheduler.tick_hooks.extend(tick_hooks)
    for f in setup:
        f(scheduler)
    for host, fail_at, back_at in config.host_failures:
        push_call(fail_at, _host_failure(scheduler, backend, push_call, host, fail_at, back_at))
    if arrivals is not None:
        push_arrivals(arrivals.start())
    tick = config.tick_interval
    firsts = ([requests[0].arrival_time] if requests else []) + ([heap[0][0]] if heap else [])
    if tick > 0 and firsts:
        heapq.heappush(heap, (min(firsts) + tick, _TICK, 0, None))

    # The run allocates many small acyclic objects; the cyclic collector only costs time here.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _run_events(requests, heap, scheduler, tick, queued)
    finally:
        if gc_was_enabled:
            gc.enable()
    if scheduler.num_in_flight:
        raise RuntimeError(f"{scheduler.num_in_flight} requests still in flight at the end")
    errors = scheduler.membership.errors
    if errors:
        raise RuntimeError(f"{len(errors)} error(s) of the router, a hook or the backend during "
                           f"the run (each request ran or failed with it); the first: {errors[0]}")
    return records


def _host_failure(scheduler: Scheduler, backend: SimulatedBackend, push_call, host: int,
                  fail_at: float, back_at: float | None) -> Callable[[], None]:
    """The event of host `host` failing at `fail_at`: its workers are lost
    (`Scheduler.lose_workers`; nothing happens when it has none), and at `back_at` (if given) it
    joins again as new workers of the degrees it had when it failed."""
    def fail() -> None:
        ids = scheduler.membership.host_worker_ids(host)
        if not ids:
            return
        specs = [scheduler.workers[w].spec for w in ids if w in scheduler.workers]
        scheduler.lose_workers(ids, fail_at, f"host {host} failed (simulated)")
        backend.drop_workers(ids, fail_at)
        if back_at is not None:
            push_call(back_at, lambda: back(specs))

    def back(specs: list[WorkerSpec]) -> None:
        new = [dataclasses.replace(sp, worker_id=wid)
               for sp, wid in zip(specs, scheduler.new_worker_ids(len(specs)))]
        backend.add_workers(new)
        scheduler.add_workers(new, back_at)

    return fail


def _run_events(requests: Sequence[Request], heap: list, scheduler: Scheduler, tick: float,
                queued: list[int]) -> None:
    """The event loop; `queued[0]` counts the arrival events on the heap (closed loop)."""
    i, n = 0, len(requests)
    arrivals = [r.arrival_time for r in requests]
    submit, complete = scheduler.submit, scheduler.backend.finish_prefill
    heappop = heapq.heappop
    while i < n or heap:
        if i < n and (not heap or arrivals[i] < heap[0][0]
                      or (arrivals[i] == heap[0][0] and heap[0][1] > _ARRIVAL)):
            submit(requests[i], arrivals[i])
            i += 1
            continue
        t, kind, _, payload = heappop(heap)
        if kind == _COMPLETE:
            complete(payload, t)
        elif kind == _CALL:
            payload()
        elif kind == _ARRIVAL:
            queued[0] -= 1
            submit(payload, t)
        else:
            scheduler.tick(t)
            if not heap and i >= n and scheduler.num_in_flight and not scheduler.reconfig.in_progress:
                break  # requests wait for workers that will never come back: reported below
            busy = scheduler.num_in_flight or scheduler.reconfig.in_progress or len(heap) > queued[0]
            if busy:
                heapq.heappush(heap, (t + tick, _TICK, 0, None))
            elif i < n or heap:  # idle until the next arrival: no point ticking through the gap
                nxt = min(requests[i].arrival_time if i < n else math.inf, heap[0][0] if heap else math.inf)
                heapq.heappush(heap, (max(t + tick, nxt), _TICK, 0, None))
