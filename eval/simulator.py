"""Discrete-event simulation of the prefill pool, driving the same `serving.Scheduler` that serves.

The simulated backend charges each prefill the ground-truth time of a profile table
(`eval.ground_truth.GroundTruthProfile`, optionally noisy) for the hit its worker's local LRU
cache actually gives, while the router only sees the fitted cost model and the prefix index
built from KV events, so the router is never omniscient (DESIGN.md, "One policy core, two
backends"). TTFT adds the KV transfer to the decode pool and one decode step, as the paper
counts TTFT for a disaggregated prefill pool.

Events are (time, sequence, kind, payload) on a heap; arrivals are merged from the sorted
request list; ties are ordered completions first, then arrivals, then ticks, then by sequence.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
from collections.abc import Callable, Sequence

from eval.local_cache import LocalPrefixCache, split_cache
from serving.backend import PrefillResult
from serving.request import Request
from serving.router import Router
from serving.scheduler import CostModel, RequestRecord, Scheduler
from serving.worker import WorkerSpec

_COMPLETE, _RECARVE, _ARRIVAL, _TICK = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Costs outside prefill and the simulator's periodic tick.

    Attributes:
      kv_bytes_per_token: bytes of K and V of one token, all layers (the model's KV size).
      kv_transfer_gb_per_s: bandwidth of the KV transfer to the decode pool, GB/s (1e9 bytes/s);
        0 disables the transfer cost. Default 50 GB/s: one 400 Gb/s RDMA NIC.
      first_token_seconds: time of the decode step that emits the first token (seconds).
      tick_interval: seconds between `Scheduler.tick` calls (controller, cache manager); 0 disables.
      recarve_seconds: time of a split or merge after the drain (new meshes, executables,
        KV re-striping), seconds. The paper measured 1.1 to 5.1 s per operation, most of it
        drain, which the simulator models separately.
    """

    kv_bytes_per_token: int = 0
    kv_transfer_gb_per_s: float = 50.0
    first_token_seconds: float = 0.02
    tick_interval: float = 1.0
    recarve_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        if self.kv_transfer_gb_per_s < 0:
            raise ValueError(f"kv_transfer_gb_per_s must be >= 0, got {self.kv_transfer_gb_per_s}")
        if self.first_token_seconds < 0:
            raise ValueError(f"first_token_seconds must be >= 0, got {self.first_token_seconds}")
        if self.tick_interval < 0:
            raise ValueError(f"tick_interval must be >= 0 seconds, got {self.tick_interval}")
        if self.recarve_seconds < 0:
            raise ValueError(f"recarve_seconds must be >= 0 seconds, got {self.recarve_seconds}")

    def after_prefill_seconds(self, input_len: int) -> float:
        """KV transfer of `input_len` tokens plus the first decode step, in seconds."""
        t = self.first_token_seconds
        if self.kv_transfer_gb_per_s > 0:
            t += input_len * self.kv_bytes_per_token / (self.kv_transfer_gb_per_s * 1e9)
        return t


class SimulatedBackend:
    """`serving.backend.Backend` over simulated workers: an LRU cache each and a profile clock.

    Args:
      workers: the pool's workers.
      prefill_seconds: ground truth `(cp_degree, input_len, cached_len) -> seconds`.
      config: `SimConfig`.
      push_completion: callback `(finish_time, worker_id, request_id, PrefillResult)` that the
        simulator turns into a completion event.
      push_recarve: callback `(time, epoch, cached_blocks)` that the simulator turns into
        `Scheduler.finish_reconfiguration`.
    """

    def __init__(self, workers: Sequence[WorkerSpec],
                 prefill_seconds: Callable[[int, int, int], float], config: SimConfig,
                 push_completion: Callable[[float, int, str | int, PrefillResult], None],
                 push_recarve: Callable[[float, int, dict], None] | None = None) -> None:
        self.caches = {w.worker_id: LocalPrefixCache(w.kv_capacity_blocks) for w in workers}
        self.degrees = {w.worker_id: w.cp_degree for w in workers}
        self._prefill_seconds = prefill_seconds
        self._config = config
        self._push = push_completion
        self._push_recarve = push_recarve

    def recarve(self, reconfiguration, now: float) -> None:
        """Split or merge the caches of drained workers; done `recarve_seconds` later.

        Merge: the new worker holds the union of both halves' blocks (re-striped lazily: the
        re-striping cost is inside `recarve_seconds`). Split: `split_cache` assigns each
        retained prefix to one half.
        """
        rec = reconfiguration
        olds = [self.caches.pop(w) for w in rec.old_ids]
        for w in rec.old_ids:
            del self.degrees[w]
        if rec.kind == "merge":
            [spec] = rec.new_specs
            merged = LocalPrefixCache(spec.kv_capacity_blocks)
            for cache in olds:
                merged.adopt(cache.blocks())
            new = {spec.worker_id: merged}
        else:
            [old] = olds
            a, b = rec.new_specs
            halves = split_cache(old, a.kv_capacity_blocks)
            new = {a.worker_id: halves[0], b.worker_id: halves[1]}
        for spec in rec.new_specs:
            self.caches[spec.worker_id] = new[spec.worker_id]
            self.degrees[spec.worker_id] = spec.cp_degree
        blocks = {wid: [h for h, _ in c.blocks()] for wid, c in new.items()}
        self._push_recarve(now + self._config.recarve_seconds, rec.epoch, blocks)

    def start_prefill(self, worker_id: int, request: Request, now: float) -> None:
        cache = self.caches[worker_id]
        bs = request.block_size
        total = -(-request.input_len // bs)
        hit, evicted = cache.begin(request.block_hashes, request.max_cacheable_blocks, total)
        cached_len = hit * bs
        finish = now + self._prefill_seconds(self.degrees[worker_id], request.input_len, cached_len)
        inserted = cache.finish(request.block_hashes, hit, request.full_blocks, total)
        # The new blocks are reported at completion, the time they become readable.
        self._push(finish, worker_id, request.request_id, PrefillResult(
            cached_len, finish, finish + self._config.after_prefill_seconds(request.input_len),
            inserted, evicted))


def simulate(requests: Sequence[Request], workers: Sequence[WorkerSpec], cost_model: CostModel,
             router: Router, prefill_seconds: Callable[[int, int, int], float],
             config: SimConfig = SimConfig(),
             tick_hooks: Sequence[Callable[[Scheduler, float], None]] = (),
             setup: Sequence[Callable[[Scheduler], None]] = ()) -> list[RequestRecord]:
    """Replays `requests` (sorted by arrival) through a simulated pool.

    Args:
      requests: the workload, sorted by `arrival_time` (seconds).
      workers: initial pool composition.
      cost_model: the router's estimate of prefill seconds (fitted, not the ground truth).
      router: routing policy.
      prefill_seconds: ground-truth prefill seconds `(cp_degree, input_len, cached_len)`.
      config: `SimConfig`.
      tick_hooks: periodic hooks `(scheduler, now)`, run every `config.tick_interval` seconds.
      setup: called with the `Scheduler` before the run (attach a controller, keep a handle to
        read its logs afterwards).

    Returns:
      One `RequestRecord` per request, in completion order.

    Raises:
      ValueError: requests not sorted by arrival time.
      RuntimeError: the run ended with requests still in flight (a scheduler bug).
    """
    for a, b in zip(requests, requests[1:]):
        if b.arrival_time < a.arrival_time:
            raise ValueError(f"requests must be sorted by arrival_time; {b.request_id!r} at "
                             f"{b.arrival_time} follows {a.request_id!r} at {a.arrival_time}")
    records: list[RequestRecord] = []
    heap: list = []
    seq = 0

    def push_completion(t: float, worker_id: int, request_id, result: PrefillResult) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, _COMPLETE, seq, (worker_id, request_id, result)))

    def push_recarve(t: float, epoch: int, blocks: dict) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, _RECARVE, seq, (epoch, blocks)))

    backend = SimulatedBackend(workers, prefill_seconds, config, push_completion, push_recarve)
    scheduler = Scheduler(workers, cost_model, router, backend, listener=records.append)
    scheduler.tick_hooks.extend(tick_hooks)
    for f in setup:
        f(scheduler)
    tick = config.tick_interval
    if tick > 0 and requests:
        heapq.heappush(heap, (requests[0].arrival_time + tick, _TICK, 0, None))

    # The run allocates many small acyclic objects; the cyclic collector only costs time here.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _run_events(requests, heap, scheduler, tick)
    finally:
        if gc_was_enabled:
            gc.enable()
    if scheduler.num_in_flight:
        raise RuntimeError(f"{scheduler.num_in_flight} requests still in flight at the end")
    return records


def _run_events(requests: Sequence[Request], heap: list, scheduler: Scheduler, tick: float) -> None:
    i, n = 0, len(requests)
    submit, complete = scheduler.submit, scheduler.complete
    heappop = heapq.heappop
    while i < n or heap:
        if i < n and (not heap or requests[i].arrival_time < heap[0][0]
                      or (requests[i].arrival_time == heap[0][0] and heap[0][1] > _ARRIVAL)):
            r = requests[i]
            i += 1
            submit(r, r.arrival_time)
            continue
        t, kind, _, payload = heappop(heap)
        if kind == _COMPLETE:
            complete(payload[0], payload[1], t, payload[2])
        elif kind == _RECARVE:
            scheduler.finish_reconfiguration(payload[0], t, payload[1])
        else:
            scheduler.tick(t)
            if i < n or scheduler.num_in_flight or scheduler.reconfigurations:
                heapq.heappush(heap, (t + tick, _TICK, 0, None))
