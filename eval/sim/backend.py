"""The simulated backend: per-worker LRU prefix caches and a ground-truth clock.

Implements `serving.policy.backend.Backend` for `eval.sim.simulator.simulate`: prefills are charged the
ground-truth time for the hit the worker's local cache actually gives; split and merge re-carve
caches (`eval.sim.local_cache.split_cache`); prefix copies and reclamations change caches when they
complete, and only then reach the scheduler's prefix index. Workers carry a host id: a copy
between hosts runs at the scale-out bandwidth (`SimConfig.scaleout_gb_per_s`), and a host can
fail and come back (`SimConfig.host_failures`, driven by `eval.sim.simulator`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from eval.sim.local_cache import LocalPrefixCache, split_cache_parts
from serving.fetch_wait import FetchWaits
from serving.policy.backend import PrefillResult
from serving.policy.checks import require_finite
from serving.policy.replication import SCALEOUT_GB_PER_S, copy_seconds, link_gb_per_s
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
      replication_gb_per_s: bandwidth of prefix copies between workers of one host, GB/s;
        0 = instant. Default 100 GB/s: well under NVLink's 450 GB/s per direction, as copies
        compete with the CP all-gathers.
      scaleout_gb_per_s: bandwidth of prefix copies between workers of different hosts, GB/s;
        0 = instant. Default 25 GB/s, one 200 Gb/s NIC
        (`serving.policy.replication.SCALEOUT_GB_PER_S` says why).
      gpus_per_host: devices per host (the paper's pool: 5 hosts of 8); workers get host
        `first_device // gpus_per_host` and never span hosts. 0 (default): every GPU on one
        host, as before hosts existed.
      host_failures: `(host, fail_time_s, back_time_s or None)` per simulated host failure:
        at `fail_time_s` the host's workers are lost (`Scheduler.lose_workers`), and at
        `back_time_s` (if given) the host joins again as new workers of the same degrees.
    """

    kv_bytes_per_token: int = 0
    kv_transfer_gb_per_s: float = 50.0
    first_token_seconds: float = 0.02
    tick_interval: float = 1.0
    recarve_seconds: float = 1.0
    replication_gb_per_s: float = 100.0
    scaleout_gb_per_s: float = SCALEOUT_GB_PER_S
    gpus_per_host: int = 0
    host_failures: tuple[tuple[int, float, float | None], ...] = ()

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
        if not self.scaleout_gb_per_s >= 0:
            raise ValueError(f"scaleout_gb_per_s must be >= 0, got {self.scaleout_gb_per_s}")
        if isinstance(self.gpus_per_host, bool) or not isinstance(self.gpus_per_host, int) \
                or self.gpus_per_host < 0:
            raise ValueError(f"gpus_per_host must be an integer >= 0 (0 = one host), got "
                             f"{self.gpus_per_host!r}")
        for f in self.host_failures:
            ok = isinstance(f, tuple) and len(f) == 3 and isinstance(f[0], int) and f[0] >= 0
            ok = ok and isinstance(f[1], (int, float)) and 0 <= f[1] < float("inf")
            ok = ok and (f[2] is None or (isinstance(f[2], (int, float)) and f[1] < f[2] < float("inf")))
            if not ok:
                raise ValueError(f"host_failures entries must be (host >= 0, fail time >= 0 s, "
                                 f"back time > fail time or None), got {f!r}")

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
        self.hosts = {w.worker_id: w.host for w in workers}
        self._prefill_seconds = prefill_seconds
        self._config = config
        self._push = push_completion
        self._push_call = push_call
        self.scheduler = None
        # The copies made for requests, and the prefills held behind them: the live backends'
        # own (`serving.fetch_wait`), so both hold and release a prefill by one rule. A request
        # re-routed while its copy is in flight (its worker began a split or merge) may get a
        # new copy elsewhere; the old one then neither holds nor releases it.
        self.waits = FetchWaits()
        self._now = 0.0  # the time of the event that starts held prefills (`waits`)

    def recarve(self, reconfiguration, now: float) -> None:
        """Split or merge the caches of drained workers; done `recarve_seconds` later.

        Merge: the new worker holds the union of both halves' blocks (re-striped lazily: the
        re-striping cost is inside `recarve_seconds`). Split: `split_cache` assigns each
        retained prefix to one half (into more parts, in one re-carve: again within each half,
        `split_cache_parts`).
        """
        rec = reconfiguration
        olds = [self.caches.pop(w) for w in rec.old_ids]
        for w in rec.old_ids:
            del self.degrees[w], self.hosts[w]
        if rec.kind == "merge":
            [spec] = rec.new_specs
            merged = LocalPrefixCache(spec.kv_capacity_blocks)
            for cache in olds:
                merged.adopt(cache.blocks())
            merged.restore_ancestor_order()
            new = {spec.worker_id: merged}
        else:
            [old] = olds
            specs = sorted(rec.new_specs, key=lambda s: s.first_device)
            caches = split_cache_parts(old, [s.cp_degree for s in specs],
                                       specs[0].kv_capacity_blocks // specs[0].cp_degree)
            new = {s.worker_id: c for s, c in zip(specs, caches)}
        for spec in rec.new_specs:
            self.caches[spec.worker_id] = new[spec.worker_id]
            self.degrees[spec.worker_id] = spec.cp_degree
            self.hosts[spec.worker_id] = spec.host
        blocks = {wid: [h for h, _ in c.blocks()] for wid, c in new.items()}
        done_at = now + self._config.recarve_seconds

        def finish():
            self.scheduler.finish_reconfiguration(rec.epoch, done_at, blocks)
            # (a change abandoned because its host failed activates nothing; a new worker that
            # a reconfigured hook already began to re-carve has handed its cache on)
            self._share({w: c for w, c in new.items()
                         if w in self.scheduler.workers and self.caches.get(w) is c})

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

    def add_workers(self, specs: Sequence[WorkerSpec]) -> None:
        """Empty caches for workers joining the pool (a host back), shared with the index; call
        before `Scheduler.add_workers`."""
        for w in specs:
            self.caches[w.worker_id] = LocalPrefixCache(w.kv_capacity_blocks)
            self.degrees[w.worker_id], self.hosts[w.worker_id] = w.cp_degree, w.host
        self._share({w.worker_id: self.caches[w.worker_id] for w in specs})

    def drop_workers(self, worker_ids, now: float) -> None:
        """Forgets workers lost at `now` (their host failed; `Scheduler.lose_workers` ran):
        their caches go, and their pending prefill completions are dropped (`finish_prefill`).
        A copy from or to one of them never lands: a prefill held behind it on a worker still
        there starts now, on its local prefix (`FetchWaits.workers_lost`)."""
        ids = list(worker_ids)
        for w in ids:
            self.caches.pop(w, None)
            self.degrees.pop(w, None)
            self.hosts.pop(w, None)
        self._now = now
        self.waits.workers_lost(ids)

    def replicate(self, replication, now: float) -> None:
        """Copies the missing blocks at `replication_gb_per_s` within a host, at
        `scaleout_gb_per_s` across hosts; visible when the copy is done. A copy whose source or
        destination is lost meanwhile changes nothing (`PrefixCopies.drop_workers`).

        The source's blocks are read when the copy starts (the simulated copy does not occupy
        either worker's prefill queue: NVLink/RDMA DMA in the background). A copy made for one
        request (`Replication.request_id`, a router's transfer plan) holds that request's
        prefill until it ends, or until a worker of it is lost (`start_prefill`,
        `drop_workers`).
        """
        rep, cfg = replication, self._config
        bw = link_gb_per_s(self.hosts.get(rep.src, 0), self.hosts.get(rep.dst, 0),
                           cfg.replication_gb_per_s, cfg.scaleout_gb_per_s)
        done = now + copy_seconds(rep.num_blocks, rep.block_size, cfg.kv_bytes_per_token, bw)
        self.waits.copy_started(rep)

        def finish():
            cache = self.caches.get(rep.dst)
            if cache is None or self.scheduler.copies.is_dropped(rep):
                cache = None  # a worker of the copy was lost: nothing arrives
            inserted, evicted = cache.insert_chain(rep.chain) if cache is not None else ([], [])
            self.scheduler.copies.finish(rep, done, inserted, evicted)
            self._now = done
            self.waits.copy_ended(rep)  # starts the prefill held for it, on what landed

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
        copy ends (the worker waits: TTFT = queue + transfer + prefill, as Mooncake's
        Conductor estimates it), or when a worker of the copy is lost (`drop_workers`)."""
        if self.waits.hold(worker_id, request.request_id,
                           lambda: self.start_prefill(worker_id, request, self._now)):
            return
        cache = self.caches.get(worker_id)
        if cache is None:
            return  # the worker was lost: the scheduler failed the request
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
        if worker_id not in self.caches:
            return  # the worker was lost mid-prefill: `Scheduler.lose_workers` failed it
        bs = request.block_size
        inserted = self.caches[worker_id].finish(request.block_hashes, hit,
                                                 request.input_len // bs, total)  # full blocks
        self.scheduler.complete(worker_id, request.request_id, now, PrefillResult(
            hit * bs, now, now + self._config.after_prefill_seconds(request.input_len), inserted))
