"""The simulated backend: per-worker LRU prefix caches and a ground-truth clock.

Implements `serving.policy.backend.Backend` for `eval.sim.simulator.simulate`: prefills are charged the
ground-truth time for the hit the worker's local cache actually gives; split and merge re-carve
caches (`eval.sim.local_cache.split_cache`); prefix copies and reclamations change caches when they
complete, and only then reach the scheduler's prefix index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from eval.sim.local_cache import LocalPrefixCache, split_cache
from serving.policy.backend import PrefillResult
from serving.policy.checks import require_finite
from serving.policy.replication import copy_seconds
from serving.policy.request import Request
from serving.policy.worker import WorkerSpec


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
      replication_gb_per_s: bandwidth of prefix copies between workers, GB/s; 0 = instant.
        Default 100 GB/s: well under NVLink's 450 GB/s per direction, as copies compete with
        the CP all-gathers.
    """

    kv_bytes_per_token: int = 0
    kv_transfer_gb_per_s: float = 50.0
    first_token_seconds: float = 0.02
    tick_interval: float = 1.0
    recarve_seconds: float = 1.0
    replication_gb_per_s: float = 100.0

    def __post_init__(self) -> None:
        require_finite(self, ("kv_transfer_gb_per_s", "first_token_seconds", "tick_interval",
                     "recarve_seconds", "replication_gb_per_s"))
        if 0 < self.tick_interval < 1e-3:
            raise ValueError(f"tick_interval must be 0 (off) or >= 1e-3 s, got {self.tick_interval}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        if self.kv_transfer_gb_per_s < 0:
            raise ValueError(f"kv_transfer_gb_per_s must be >= 0, got {self.kv_transfer_gb_per_s}")
        if self.first_token_seconds < 0:
            raise ValueError(f"first_token_seconds must be >= 0, got {self.first_token_seconds}")
        if self.tick_interval < 0:
            raise ValueError(f"tick_interval must be >= 0 seconds, got {self.tick_interval}")
        if self.replication_gb_per_s < 0:
            raise ValueError(f"replication_gb_per_s must be >= 0, got {self.replication_gb_per_s}")
        if self.recarve_seconds < 0:
            raise ValueError(f"recarve_seconds must be >= 0 seconds, got {self.recarve_seconds}")

    def after_prefill_seconds(self, input_len: int) -> float:
        """KV transfer of `input_len` tokens plus the first decode step, in seconds."""
        t = self.first_token_seconds
        if self.kv_transfer_gb_per_s > 0:
            t += input_len * self.kv_bytes_per_token / (self.kv_transfer_gb_per_s * 1e9)
        return t


class SimulatedBackend:
    """`serving.policy.backend.Backend` over simulated workers: an LRU cache each and a profile clock.

    Args:
      workers: the pool's workers.
      prefill_seconds: ground truth `(cp_degree, input_len, cached_len) -> seconds`.
      config: `SimConfig`.
      push_completion: callback `(finish_time, payload)` that the simulator turns into a
        completion event, handled by `finish_prefill(payload, finish_time)`.
      push_call: callback `(time, fn)`: the simulator calls `fn()` at `time` (copies,
        reclamations and re-carves finishing).

    `scheduler` must be set (by the simulator) before the first event.
    """

    def __init__(self, workers: Sequence[WorkerSpec],
                 prefill_seconds: Callable[[int, int, int], float], config: SimConfig,
                 push_completion: Callable[[float, tuple], None],
                 push_call: Callable[[float, Callable[[], None]], None]) -> None:
        self.caches = {w.worker_id: LocalPrefixCache(w.kv_capacity_blocks) for w in workers}
        self.degrees = {w.worker_id: w.cp_degree for w in workers}
        self._prefill_seconds = prefill_seconds
        self._config = config
        self._push = push_completion
        self._push_call = push_call
        self.scheduler = None
        # request id -> (destination, end time, copy) of the newest copy made for it; a request
        # re-routed while its copy is in flight (its worker began a split or merge) may get a
        # new copy elsewhere, and the old one neither holds nor releases it.
        self._awaited: dict[str | int, tuple[int, float, object]] = {}

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
            merged.restore_ancestor_order()
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
        done_at = now + self._config.recarve_seconds

        def finish():
            self.scheduler.finish_reconfiguration(rec.epoch, done_at, blocks)
            self._share(new)

        self._push_call(done_at, finish)

    def share_caches(self) -> None:
        """Lets the scheduler's prefix index read each worker's cache directly
        (`PrefixIndex.share_blocks`) instead of keeping a copy of it from the KV events: this
        backend reports every event in the same call that changes the cache, so the index's
        contents are the same at every call, with half the set updates. Call once `scheduler`
        is set; indexes without `share_blocks` keep their copies."""
        self._share(self.caches)

    def _share(self, caches: dict[int, LocalPrefixCache]) -> None:
        share = getattr(self.scheduler.prefix_index, "share_blocks", None)
        if share is not None:
            for worker_id, cache in caches.items():
                share(worker_id, cache.block_view())

    def replicate(self, replication, now: float) -> None:
        """Copies the missing blocks at `replication_gb_per_s`; visible when the copy is done.

        The source's blocks are read when the copy starts (the simulated copy does not occupy
        either worker's prefill queue: NVLink/RDMA DMA in the background). A copy made for one
        request (`Replication.request_id`, a router's transfer plan) holds that request's
        prefill until it is done (`start_prefill`).
        """
        rep = replication
        done = now + copy_seconds(rep.num_blocks, rep.block_size, self._config.kv_bytes_per_token,
                                  self._config.replication_gb_per_s)
        if rep.request_id is not None:
            self._awaited[rep.request_id] = (rep.dst, done, rep)

        def finish():
            if rep.request_id is not None:
                entry = self._awaited.get(rep.request_id)
                if entry is not None and entry[2] is rep:
                    del self._awaited[rep.request_id]
            cache = self.caches.get(rep.dst)
            inserted, evicted = cache.insert_chain(rep.chain) if cache is not None else ([], [])
            self.scheduler.copies.finish(rep, done, inserted, evicted)

        self._push_call(done, finish)

    def reclaim(self, worker_id: int, chain, now: float) -> None:
        """Frees the worker's unshared tail of `chain`; confirmed at once."""
        def finish():
            cache = self.caches.get(worker_id)
            evicted = cache.reclaim_suffix(chain) if cache is not None else []
            self.scheduler.copies.finish_reclaim(worker_id, chain, now, evicted)

        self._push_call(now, finish)

    def start_prefill(self, worker_id: int, request: Request, now: float) -> None:
        """Takes the hit and makes room now (evictions reported at once, as KV events); the new
        blocks are cached and reported when the prefill completes (`finish_prefill`). A request
        whose prefix is still being copied to the worker for it (`replicate`) starts when the
        copy is done (the worker waits: TTFT = queue + transfer + prefill, as Mooncake's
        Conductor estimates it)."""
        if self._awaited:
            entry = self._awaited.get(request.request_id)
            if entry is not None and entry[0] == worker_id:  # (a zero-time copy too)
                # The copy's completion was scheduled first: at `done` it has been cached and
                # the request no longer awaits it.
                done = entry[1]
                self._push_call(done, lambda: self.start_prefill(worker_id, request, done))
                return
        cache = self.caches[worker_id]
        bs, n = request.block_size, request.input_len
        total = -(-n // bs)
        hit, evicted = cache.begin(request.block_hashes, (n - 1) // bs, total)  # max cacheable
        if evicted:
            self.scheduler.kv_events(worker_id, (), evicted)
        finish = now + self._prefill_seconds(self.degrees[worker_id], n, hit * bs)
        self._push(finish, (worker_id, request, hit, total))

    def finish_prefill(self, payload: tuple, now: float) -> None:
        """The completion event of `start_prefill`: caches the new full blocks, reports them."""
        worker_id, request, hit, total = payload
        bs = request.block_size
        inserted = self.caches[worker_id].finish(request.block_hashes, hit,
                                                 request.input_len // bs, total)  # full blocks
        self.scheduler.complete(worker_id, request.request_id, now, PrefillResult(
            hit * bs, now, now + self._config.after_prefill_seconds(request.input_len), inserted))
