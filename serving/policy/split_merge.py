"""The split/merge half of `Scheduler`: its epochs, composition and the two calls that begin
and finish a change (`serving.policy.reconfiguration.Reconfigurations` keeps the changes in
progress; `Membership` re-routes the drained queues).

A mixin, not a collaborator: the calls are `Scheduler`'s public API (the controllers and the
backends call `scheduler.begin_reconfiguration`), and they touch the scheduler's queues and
hooks directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.policy.reconfiguration import Reconfiguration
from serving.policy.worker import WorkerSpec, WorkerState, WorkerStatus


class SplitMerge:
    """Split and merge for `Scheduler` (which it is mixed into; it keeps no state of its own)."""

    @property
    def epoch(self) -> int:
        """The latest epoch (`Reconfigurations.epoch`)."""
        return self.reconfig.epoch

    @property
    def composition(self) -> list[int]:
        """CP degrees of the pool's workers in device order (draining ones included)."""
        return [w.cp_degree for w in sorted(self.workers.values(), key=lambda w: w.spec.first_device)]

    def new_worker_ids(self, n: int) -> tuple[int, ...]:
        """`n` fresh worker ids (never reused; `Reconfigurations.new_worker_ids`)."""
        return self.reconfig.new_worker_ids(n)

    def begin_reconfiguration(self, kind: str, old_ids: Sequence[int],
                              new_specs: Sequence[WorkerSpec], now: float) -> Reconfiguration:
        """Starts a split or merge: drain `old_ids`, later replace them by `new_specs`.

        The old workers stop taking placements at once; their queued (not started) requests
        are re-routed through the router (and, still queued when the change is done, placed
        again: `Reconfiguration.displaced`); a running prefill finishes under the old geometry.
        When every old worker is idle the backend's `recarve(reconfiguration, now)` runs, and
        `finish_reconfiguration` activates the new workers under a new epoch.

        Raises:
          ValueError: (nothing changed) the change is not a legal split or merge of the pool
            (`Reconfigurations.check` says which rule it breaks).
          StrandedRequests: (a ValueError; nothing changed) requests queued or waiting that
            no worker of the pool after the change could hold (`Reconfigurations.stranded`).
        """
        waiting = [r for w in self.workers.values() for r in w.queue] + list(self._pending)
        waiting += [r for batch in self.membership.placing for r in batch]  # (a hook's change)
        olds = self.reconfig.admit(kind, old_ids, new_specs, self.workers, waiting)
        rec = self.reconfig.open(kind, old_ids, new_specs, now)
        requeue = []
        for w in olds:
            w.status = WorkerStatus.DRAINING
            requeue += self.membership.unqueue(w)
        requeue.sort(key=lambda r: r.arrival_time)
        rec.displaced = tuple(r.request_id for r in requeue)
        self.membership.place_again(requeue, now)
        self._maybe_recarve(rec, now)
        return rec

    def finish_reconfiguration(self, epoch: int, now: float,
                               cached_blocks: dict[int, Sequence[int]]) -> None:
        """The backend re-carved: the old workers leave, the new ones become ACTIVE, and the
        requests the change displaced that still wait in a queue are placed again (they were
        placed before the new workers existed: `Reconfiguration.displaced`), then those that
        waited for a worker; both count as displaced by the changes still in progress, placed
        again when each is done (with every worker draining, the first change done would
        otherwise keep what waited). Then `reconfigured_hooks` run (an exception of one comes
        out after the change is made).

        Args:
          epoch, now: the reconfiguration's epoch; seconds.
          cached_blocks: per new worker id, the block hashes it holds after the change
            (retained prefixes stay resident; DESIGN.md "Cluster-level loops").

        Raises:
          ValueError: no change of that epoch is re-carving (an abandoned one is ignored).
        """
        rec = self.reconfig.close(epoch)
        if rec is None:
            return
        for wid in rec.old_ids:
            del self.workers[wid]
            self.prefix_index.drop_worker(wid)
        for spec in rec.new_specs:
            self.workers[spec.worker_id] = WorkerState(spec, epoch=epoch)
            self.prefix_index.register_worker(spec.worker_id, spec.cp_degree)
            self.prefix_index.insert(spec.worker_id, cached_blocks.get(spec.worker_id, ()))
        self.reconfig.record(rec, now, self.composition)
        self._place_displaced(rec, now)
        for hook in self.reconfigured_hooks:
            hook(self, now)

    def abandon_reconfiguration(self, epoch: int, now: float) -> Reconfiguration:
        """The backend could not re-carve the change of `epoch` and changed nothing (its old
        workers are as they were, drained): the change is given up (`Reconfigurations.
        abandon`, its epoch in `reconfig.refused`; its new workers never appear), its old
        workers take placements again, and the requests it displaced and those waiting for a
        worker are placed again (the changes still in progress take their share when done, as
        `finish_reconfiguration` does). Returns the change.

        Raises:
          ValueError: (nothing changed) no change of that epoch is in progress.
        """
        rec = self.reconfig.abandon(epoch)
        self.reconfig.refused.add(epoch)
        for wid in rec.old_ids:
            w = self.workers.get(wid)
            if w is not None and w.status is WorkerStatus.DRAINING:
                w.status = WorkerStatus.ACTIVE
        self._place_displaced(rec, now)  # (its old workers included)
        return rec

    def _place_displaced(self, rec: Reconfiguration, now: float) -> None:
        """A change ended (made or given up): the requests it displaced that still wait in a
        queue are placed again, then those that waited for a worker; both count as displaced
        by the changes still in progress, placed again when each ends."""
        moved, waiting = self.membership.unqueue_ids(rec.displaced), list(self._pending)
        self.membership.place_again(moved, now)
        self._retry_pending(now)
        for later in self.reconfig.in_progress.values():
            later.displaced += tuple(r.request_id for r in moved + waiting)

    def _recarve_drained(self, worker: WorkerState, now: float) -> None:
        """A draining worker went idle: re-carves each change of it whose old workers all are."""
        for rec in self.reconfig.involving(worker.worker_id):
            self._maybe_recarve(rec, now)

    def _maybe_recarve(self, rec: Reconfiguration, now: float) -> None:
        if self.reconfig.in_progress.get(rec.epoch) is not rec:
            return  # abandoned (a hook lost a worker of it)
        if rec.recarve_started is None and all(self.workers[w].running is None for w in rec.old_ids):
            rec.recarve_started = now
            self.backend.recarve(rec, now)
