"""Split and merge in the scheduler: drain, re-route, re-carve, new epoch (paper section 6).

`ReconfigurationMixin` is part of `serving.scheduler.Scheduler`; the policy deciding *when* and
*what* to reconfigure is `serving.controller.ReconfigurationController`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from serving.worker import WorkerSpec, WorkerState, WorkerStatus

@dataclasses.dataclass
class Reconfiguration:
    """A split or merge in progress (paper section 6, "protocol").

    Attributes:
      kind: "split" or "merge".
      old_ids: the draining workers.
      new_specs: the workers that replace them (same devices).
      epoch: the epoch the new workers are created under.
      started: when draining began (seconds); recarve_started: when the last old worker went
        idle and the backend began re-carving (None while draining).
    """

    kind: str
    old_ids: tuple[int, ...]
    new_specs: tuple[WorkerSpec, ...]
    epoch: int
    started: float
    recarve_started: float | None = None


class ReconfigurationMixin:
    """Scheduler methods for split and merge (see `Scheduler`)."""

    def new_worker_ids(self, n: int) -> tuple[int, ...]:
        """Fresh worker ids (never reused)."""
        ids = tuple(range(self._next_worker_id, self._next_worker_id + n))
        self._next_worker_id += n
        return ids

    def begin_reconfiguration(self, kind: str, old_ids: Sequence[int],
                              new_specs: Sequence[WorkerSpec], now: float) -> Reconfiguration:
        """Starts a split or merge: drain `old_ids`, later replace them by `new_specs`.

        The old workers stop taking placements at once; their queued (not started) requests
        are re-routed through the router; a running prefill finishes under the old geometry.
        When every old worker is idle the backend's `recarve(reconfiguration, now)` runs, and
        `finish_reconfiguration` activates the new workers under a new epoch.

        Raises:
          ValueError: (nothing changed) an unknown kind, an old worker that is not ACTIVE, or
            new workers whose devices are not exactly the old workers' devices.
        """
        if kind not in ("split", "merge"):
            raise ValueError(f"kind must be 'split' or 'merge', got {kind!r}")
        olds = []
        for wid in old_ids:
            w = self.workers.get(wid)
            if w is None or w.status is not WorkerStatus.ACTIVE:
                raise ValueError(f"worker {wid} is not an ACTIVE worker of the pool")
            olds.append(w)
        old_devices = sorted(d for w in olds for d in w.spec.devices)
        new_devices = sorted(d for spec in new_specs for d in spec.devices)
        if old_devices != new_devices:
            raise ValueError(f"new workers must cover exactly devices {old_devices}, got {new_devices}")
        self.epoch += 1
        rec = Reconfiguration(kind, tuple(old_ids), tuple(new_specs), self.epoch, now)
        self.reconfigurations[rec.epoch] = rec
        requeue = []
        for w in olds:
            w.status = WorkerStatus.DRAINING
            while w.queue:
                r = w.queue.popleft()
                del self._placements[r.request_id]
                if self._use_pending:
                    self.pending.remove(w.worker_id, r.block_hashes[:r.full_blocks])
                requeue.append(r)
            w.queued_seconds = 0.0
        for r in sorted(requeue, key=lambda r: r.arrival_time):
            self._route(r, now)
        self._maybe_recarve(rec, now)
        return rec

    def finish_reconfiguration(self, epoch: int, now: float,
                               cached_blocks: dict[int, Sequence[int]]) -> None:
        """The backend re-carved: the old workers leave, the new ones become ACTIVE.

        Args:
          epoch: the reconfiguration's epoch.
          now: seconds.
          cached_blocks: per new worker id, the block hashes it holds after the change
            (retained prefixes stay resident; DESIGN.md "Cluster-level loops").

        Raises:
          ValueError: no reconfiguration of that epoch is re-carving.
        """
        rec = self.reconfigurations.get(epoch)
        if rec is None or rec.recarve_started is None:
            raise ValueError(f"no reconfiguration of epoch {epoch} is re-carving")
        del self.reconfigurations[epoch]
        for wid in rec.old_ids:
            del self.workers[wid]
            self.prefix_index.drop_worker(wid)
        for spec in rec.new_specs:
            self.workers[spec.worker_id] = WorkerState(spec, epoch=epoch)
            self.prefix_index.register_worker(spec.worker_id, spec.cp_degree)
            self.prefix_index.insert(spec.worker_id, cached_blocks.get(spec.worker_id, ()))
        self.reconfiguration_log.append({
            "epoch": epoch, "kind": rec.kind, "old": list(rec.old_ids),
            "new": [s.worker_id for s in rec.new_specs], "started": rec.started,
            "drained": rec.recarve_started, "finished": now,
            "composition": self.composition})
        self._retry_pending(now)

    @property
    def composition(self) -> list[int]:
        """CP degrees of the pool's workers in device order (draining ones included)."""
        return [w.cp_degree for w in sorted(self.workers.values(), key=lambda w: w.spec.first_device)]

    def _maybe_recarve(self, rec: Reconfiguration, now: float) -> None:
        if rec.recarve_started is None and all(self.workers[w].running is None for w in rec.old_ids):
            rec.recarve_started = now
            self.backend.recarve(rec, now)
