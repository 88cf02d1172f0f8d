"""The operator's side of the live pool: split and merge by hand, the reconfiguration log,
the prefix-cache reset and the per-worker view of `GET /v1/workers`.

`EngineAdmin` is a base of `serving.engine.Engine` (it uses the engine's `scheduler`,
`backend`, `config`, `degrees`, `now` and `_admin_epochs`); every method runs on the engine's
event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.policy.reconfiguration import Reconfiguration
from serving.policy.worker import WorkerStatus, is_aligned_tiling, merge_buddies, split_parts

# Finished splits, merges, copies and reclamations the live scheduler's logs keep (a server
# runs for months; the counters count all).
RECONFIG_LOG_LIMIT = 256


class EngineAdmin:
    """Split, merge, reconfiguration log, prefix-cache reset and worker listing of `Engine`."""

    def split(self, worker_id: int, parts: Sequence[int] | None = None) -> Reconfiguration:
        """Splits an ACTIVE worker of degree 2C into its halves, or into `parts` (CP degrees in
        device order that repeated halving makes: `serving.policy.worker.split_parts`) in one
        re-carve; returns the change (its `epoch`, `old_ids` and `new_specs`: the new
        workers' ids).

        Raises:
          StrandedRequests: (nothing changed; the new ids are handed out again,
            `Reconfigurations.admit`) waiting requests that only this worker, or one as large,
            or (with `parts`) a part as large, could hold (`Reconfigurations.refuse_stranding`).
          ValueError: (nothing changed) an unknown, draining or degree-1 worker; `parts`
            (the message starts with "parts") that halving this worker does not make, or a
            degree not among the pool's.
        """
        s = self.scheduler
        w = s.workers.get(worker_id)
        if w is None or w.status is not WorkerStatus.ACTIVE:
            raise ValueError(f"worker_id={worker_id} is not an ACTIVE worker "
                             f"(workers: {sorted(s.workers)})")
        if w.cp_degree < 2:
            raise ValueError(f"worker_id={worker_id} has cp_degree=1 and cannot be split")
        parts = [w.cp_degree // 2] * 2 if parts is None else list(parts)
        if len(parts) < 2 or not is_aligned_tiling(w.cp_degree, parts):
            raise ValueError(f"parts={parts} is not a split of worker {worker_id} (cp_degree="
                             f"{w.cp_degree}): two or more powers of two in device order "
                             "summing to its degree, each starting at a multiple of itself "
                             "(e.g. [1, 1, 2] of a 4)")
        parts = [int(c) for c in parts]  # (numpy integers as int: the mesh pool wants ints)
        for c in sorted(set(parts)):
            self._check_degree(c, "split")
        specs = split_parts(w.spec, parts, s.new_worker_ids(len(parts)),
                            self.config.max_input_len)
        rec = s.begin_reconfiguration("split", [worker_id], specs, self.now())
        self._admin_epochs.add(rec.epoch)
        return rec

    def merge(self, worker_ids: Sequence[int]) -> Reconfiguration:
        """Merges two ACTIVE buddy workers into their aligned group; returns the change (as
        `split`).

        Raises ValueError (nothing changed) unless `worker_ids` are two ACTIVE buddies, and
        StrandedRequests as `split` (one id used up).
        """
        s = self.scheduler
        if len(worker_ids) != 2 or len(set(worker_ids)) != 2:
            raise ValueError(f"worker_ids must name two distinct workers, got {list(worker_ids)}")
        ws = [s.workers.get(i) for i in worker_ids]
        if any(w is None or w.status is not WorkerStatus.ACTIVE for w in ws):
            raise ValueError(f"worker_ids={list(worker_ids)} must be ACTIVE workers "
                             f"(workers: {sorted(s.workers)})")
        a, b = sorted(ws, key=lambda w: w.spec.first_device)
        self._check_degree(2 * a.cp_degree, "merge")
        # (checked on the old ids first: a refused merge takes no new id)
        merge_buddies(a.spec, b.spec, a.worker_id, self.config.max_input_len)
        spec = merge_buddies(a.spec, b.spec, s.new_worker_ids(1)[0], self.config.max_input_len)
        rec = s.begin_reconfiguration("merge", [a.worker_id, b.worker_id], [spec], self.now())
        self._admin_epochs.add(rec.epoch)
        return rec

    def _check_degree(self, c: int, kind: str) -> None:
        if c not in self.degrees:
            raise ValueError(f"a {kind} would create CP degree {c}, not one of the pool's "
                             f"degrees {list(self.degrees)} (--degrees, each with a profile)")

    def reconfigurations(self, limit: int = RECONFIG_LOG_LIMIT) -> list[dict]:
        """The latest `limit` finished splits and merges (at most `RECONFIG_LOG_LIMIT` are kept;
        `scheduler.reconfig.num_finished` counts all), oldest first, each with `origin`: "admin"
        (the API) or "controller"."""
        log = list(self.scheduler.reconfig.log)
        return [self._with_origin(r) for r in log[max(0, len(log) - limit):]]

    def _with_origin(self, record: dict) -> dict:
        return {**record, "origin": "admin" if record["epoch"] in self._admin_epochs
                else "controller"}

    def reset_prefix_cache(self) -> int:
        """Empties every worker's prefix cache and the scheduler's index of it; returns the
        number of blocks freed (vLLM's `/reset_prefix_cache`, e.g. between benchmark runs).

        Raises ValueError (nothing changed) while requests, splits, merges, copies or
        reclamations are in flight.
        """
        s = self.scheduler
        if s.num_in_flight or s.reconfig.in_progress or s.copies.in_flight or s.copies.reclaims:
            raise ValueError("the prefix cache can be reset only while the pool is idle (no "
                             "request, split, merge, copy or reclamation in flight)")
        freed = 0
        for wid, evicted in self.backend.reset_prefix_cache().items():
            s.kv_events(wid, (), evicted)
            freed += len(evicted)
        return freed

    def workers(self) -> list[dict]:
        """Per worker (device order): id, CP degree, devices, epoch, status, queue, cache use,
        and the prefill executables created for its devices so far (one per padded length and
        cached-prefix bucket; a new one compiles on first use, seconds on a CPU, or loads from
        the persistent compilation cache)."""
        out = []
        for w in sorted(self.scheduler.workers.values(), key=lambda w: w.spec.first_device):
            view = self.backend.describe_worker(w.worker_id) or {}  # None: being re-carved
            cached = view.get("kv_blocks_cached", 0)
            compiled = view.get("prefill_executables", 0)
            out.append({
                "worker_id": w.worker_id, "cp_degree": w.cp_degree, "host": w.spec.host,
                "first_device": w.spec.first_device, "epoch": w.epoch,
                "status": w.status.name.lower(), "queued_requests": len(w.queue),
                "running": w.running is not None,
                "outstanding_seconds": w.queued_seconds + w.running_estimate,
                "kv_blocks_cached": cached, "kv_blocks_total": w.spec.kv_capacity_blocks,
                "prefill_executables": compiled})
        return out
