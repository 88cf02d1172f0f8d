"""Split and merge in the scheduler: drain, re-route, re-carve, new epoch (paper section 6).

`ReconfigurationMixin` is part of `serving.scheduler.Scheduler`; the policy deciding *when* and
*what* to reconfigure is `serving.controller.ReconfigurationController`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from serving.worker import WorkerSpec, WorkerState, WorkerStatus, are_buddies

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
          ValueError: (nothing changed) an unknown kind; old ids that are repeated, unknown or
            not ACTIVE; new ids that are repeated or already used; or a shape that is not a
            split (one worker of degree 2C into its two aligned halves) or a merge (two buddy
            workers of degree C into their aligned group of 2C), devices and KV blocks per
            device conserved.
        """
        olds = self._check_reconfiguration(kind, old_ids, new_specs)
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

    def _check_reconfiguration(self, kind, old_ids, new_specs) -> list[WorkerState]:
        if kind not in ("split", "merge"):
            raise ValueError(f"kind must be 'split' or 'merge', got {kind!r}")
        old_ids, new_specs = list(old_ids), list(new_specs)
        if len(set(old_ids)) != len(old_ids):
            raise ValueError(f"old worker ids repeat: {old_ids}")
        olds = []
        for wid in old_ids:
            w = self.workers.get(wid)
            if w is None or w.status is not WorkerStatus.ACTIVE:
                raise ValueError(f"worker {wid} is not an ACTIVE worker of the pool")
            olds.append(w)
        new_ids = [spec.worker_id for spec in new_specs]
        taken = set(self.workers) | {s.worker_id for r in self.reconfigurations.values()
                                     for s in r.new_specs}
        if len(set(new_ids)) != len(new_ids) or taken & set(new_ids):
            raise ValueError(f"new worker ids must be fresh and distinct (new_worker_ids()), got {new_ids}")
        if kind == "split":
            ok = (len(olds) == 1 and len(new_specs) == 2 and olds[0].cp_degree >= 2 and
                  sorted((s.first_device, s.cp_degree) for s in new_specs) ==
                  [(olds[0].spec.first_device + k * olds[0].cp_degree // 2, olds[0].cp_degree // 2)
                   for k in (0, 1)])
        else:
            a = olds[0].spec if olds else None
            ok = (len(olds) == 2 and len(new_specs) == 1 and are_buddies(a, olds[1].spec) and
                  (new_specs[0].first_device, new_specs[0].cp_degree) ==
                  (min(a.first_device, olds[1].spec.first_device), 2 * a.cp_degree))
        if not ok:
            raise ValueError(
                f"not a {kind}: {[(w.worker_id, w.cp_degree, w.spec.first_device) for w in olds]} -> "
                f"{[(s.worker_id, s.cp_degree, s.first_device) for s in new_specs]} (a split turns "
                "one 2C worker into its two aligned halves, a merge two buddies into their group)")
        per_device = {w.spec.kv_capacity_blocks // w.cp_degree for w in olds}
        if any(s.kv_capacity_blocks != s.cp_degree * next(iter(per_device)) for s in new_specs) \
                or len(per_device) != 1:
            raise ValueError("new workers must keep the old KV blocks per device")
        return olds

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
