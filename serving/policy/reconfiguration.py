"""Split and merge bookkeeping: epochs, fresh worker ids, changes in progress (paper section 6).

`Reconfigurations` is the collaborator `serving.policy.scheduler.Scheduler` holds as
`scheduler.reconfig`: it owns the epoch counter, the worker ids handed out, the splits and
merges in progress and the log of finished ones, and checks that a change is a legal split or
merge. The scheduler does what touches its queues (drain, re-route, activate the new workers:
`Scheduler.begin_reconfiguration` / `finish_reconfiguration`); the policy deciding *when* and
*what* to reconfigure is `serving.policy.controller.ReconfigurationController`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Mapping, Sequence

from serving.policy.request import Request
from serving.policy.worker import (WorkerSpec, WorkerState, WorkerStatus, are_buddies,
                                   is_aligned_tiling)


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
      displaced: ids of the requests queued on the old workers when draining began, placed on
        other workers then and placed again when the change is done (`Scheduler.
        finish_reconfiguration`; with those another change done meanwhile placed).
    """

    kind: str
    old_ids: tuple[int, ...]
    new_specs: tuple[WorkerSpec, ...]
    epoch: int
    started: float
    recarve_started: float | None = None
    displaced: tuple[str | int, ...] = ()


class RecarveRefused(RuntimeError):
    """A backend could not re-carve a change and changed nothing (its device pool refused it):
    what a remote backend reports in place of the new workers' blocks, so that the scheduler
    gives the change up (`Scheduler.abandon_reconfiguration`)."""


class StrandedRequests(ValueError):
    """A split or merge refused because requests waiting for a worker would fit none after it.

    Attributes:
      requests: the requests (queued on a worker or waiting for one) no worker could hold.
      largest: the largest `max_input_len` of the pool after the change (tokens).
    """

    def __init__(self, message: str, requests: Sequence[Request], largest: int) -> None:
        super().__init__(message)
        self.requests, self.largest = list(requests), largest


class Reconfigurations:
    """The pool's epochs, fresh worker ids, splits and merges in progress, and their log.

    Args:
      next_worker_id: the first id `new_worker_ids` hands out (above every initial worker's).
      log_limit: finished changes `log` keeps (the latest ones; None: all, as the simulator
        wants them); `finished` counts every one.

    Attributes:
      epoch: the latest epoch (0 for the initial workers; each change opens the next one).
      in_progress: the changes not finished yet, by epoch.
      log: one dict per finished change (epoch, kind, old and new ids, started, drained,
        finished, composition after it), in finishing order; the last `log_limit` of them.
      finished: finished changes by kind ("split", "merge"), all of them.
      abandoned: epochs of changes given up because a worker of theirs was lost, or the
        backend could not re-carve them (`abandon`); the backend's late
        `finish_reconfiguration` for one is ignored.
      refused: those of them the backend could not re-carve
        (`Scheduler.abandon_reconfiguration`).
      retired: ids of workers lost (`serving.policy.membership`); `check` never accepts one
        as a new id.
    """

    def __init__(self, next_worker_id: int, log_limit: int | None = None) -> None:
        self.epoch = 0
        self.in_progress: dict[int, Reconfiguration] = {}
        self.log: list[dict] | deque[dict] = [] if log_limit is None else deque(maxlen=log_limit)
        self.finished: Counter[str] = Counter()
        self.abandoned: set[int] = set()
        self.refused: set[int] = set()  # those of them the backend could not re-carve
        self.retired: set[int] = set()
        self._next_worker_id = next_worker_id

    @property
    def num_finished(self) -> int:
        """Finished changes, all kinds, since the start (`log` may keep fewer)."""
        return sum(self.finished.values())

    def new_worker_ids(self, n: int) -> tuple[int, ...]:
        """`n` fresh worker ids (never reused)."""
        ids = tuple(range(self._next_worker_id, self._next_worker_id + n))
        self._next_worker_id += n
        return ids

    def handed_out(self, worker_id: int) -> bool:
        """Whether `new_worker_ids` (or the initial pool) has handed out `worker_id`."""
        return 0 <= worker_id < self._next_worker_id

    def check(self, kind: str, old_ids: Sequence[int], new_specs: Sequence[WorkerSpec],
              workers: Mapping[int, WorkerState]) -> list[WorkerState]:
        """Checks that replacing `old_ids` by `new_specs` is a legal `kind` change of `workers`.

        Returns:
          The old workers, in `old_ids` order.

        Raises:
          ValueError: an unknown kind; old ids that are repeated, unknown or not ACTIVE; new
            ids that are repeated or already used; or a shape that is not a split (one worker
            into the parts repeated halving makes, in one re-carve: `is_aligned_tiling`, two
            halves or more) or a merge (two buddy workers of degree C into their aligned group
            of 2C), devices and KV blocks per device conserved.
        """
        if kind not in ("split", "merge"):
            raise ValueError(f"kind must be 'split' or 'merge', got {kind!r}")
        old_ids, new_specs = list(old_ids), list(new_specs)
        if len(set(old_ids)) != len(old_ids):
            raise ValueError(f"old worker ids repeat: {old_ids}")
        olds = []
        for wid in old_ids:
            w = workers.get(wid)
            if w is None or w.status is not WorkerStatus.ACTIVE:
                raise ValueError(f"worker {wid} is not an ACTIVE worker of the pool")
            olds.append(w)
        new_ids = [spec.worker_id for spec in new_specs]
        taken = set(workers) | self.retired | {s.worker_id for r in self.in_progress.values()
                                               for s in r.new_specs}
        if len(set(new_ids)) != len(new_ids) or taken & set(new_ids):
            raise ValueError(f"new worker ids must be fresh and distinct (new_worker_ids()), got {new_ids}")
        if kind == "split":
            parts = sorted((s.first_device, s.cp_degree) for s in new_specs)
            ok = (len(olds) == 1 and len(parts) >= 2 and
                  parts[0][0] == olds[0].spec.first_device and
                  all(a + c == b for (a, c), (b, _) in zip(parts, parts[1:])) and
                  is_aligned_tiling(olds[0].cp_degree, [c for _, c in parts]))
        else:
            a = olds[0].spec if olds else None
            ok = (len(olds) == 2 and len(new_specs) == 1 and are_buddies(a, olds[1].spec) and
                  (new_specs[0].first_device, new_specs[0].cp_degree) ==
                  (min(a.first_device, olds[1].spec.first_device), 2 * a.cp_degree))
        if not ok:
            raise ValueError(
                f"not a {kind}: {[(w.worker_id, w.cp_degree, w.spec.first_device) for w in olds]} -> "
                f"{[(s.worker_id, s.cp_degree, s.first_device) for s in new_specs]} (a split turns "
                "one worker into the aligned parts repeated halving makes, a merge two buddies "
                "into their group)")
        if {s.host for s in new_specs} != {w.spec.host for w in olds}:
            raise ValueError(f"a {kind} keeps its host: old workers on hosts "
                             f"{sorted({w.spec.host for w in olds})}, new ones on "
                             f"{sorted({s.host for s in new_specs})}")
        per_device = {w.spec.kv_capacity_blocks // w.cp_degree for w in olds}
        if any(s.kv_capacity_blocks != s.cp_degree * next(iter(per_device)) for s in new_specs) \
                or len(per_device) != 1:
            raise ValueError("new workers must keep the old KV blocks per device")
        return olds

    def admit(self, kind: str, old_ids: Sequence[int], new_specs: Sequence[WorkerSpec],
              workers: Mapping[int, WorkerState], waiting: Sequence[Request]) -> list[WorkerState]:
        """`check` then `refuse_stranding`; returns the old workers.

        A refused change burns no worker ids: when its new ids are the latest `new_worker_ids`
        handed out and none is in use, they are handed out again next time.

        Raises:
          ValueError / StrandedRequests: as `check` / `refuse_stranding` (nothing changed).
        """
        try:
            olds = self.check(kind, old_ids, new_specs, workers)
            self.refuse_stranding(old_ids, new_specs, workers, waiting)
        except ValueError:
            ids = sorted(s.worker_id for s in new_specs)
            used = set(workers) | {s.worker_id for r in self.in_progress.values()
                                   for s in r.new_specs}
            if ids == list(range(self._next_worker_id - len(ids), self._next_worker_id)) \
                    and not used & set(ids):
                self._next_worker_id -= len(ids)
            raise
        return olds

    def refuse_stranding(self, old_ids: Sequence[int], new_specs: Sequence[WorkerSpec],
                         workers: Mapping[int, WorkerState], waiting: Sequence[Request]) -> None:
        """Refuses a change after which no worker could hold some waiting request.

        The pool after the change: the workers neither in `old_ids` nor draining for a change
        in progress, the new workers of the changes in progress, and `new_specs`. A request
        fits a worker when `input_len <= max_input_len` and its blocks fit the worker's KV.

        Args:
          old_ids, new_specs: the change (already `check`ed).
          workers: the pool's workers by id.
          waiting: requests queued on a worker or waiting for one (running ones finish under
            the old geometry and are not counted).

        Raises:
          StrandedRequests: naming the requests (up to 8 ids), their longest input and the
            largest worker after the change.
        """
        leaving = set(old_ids) | {w for r in self.in_progress.values() for w in r.old_ids}
        after = [w.spec for wid, w in workers.items() if wid not in leaving]
        after += [s for r in self.in_progress.values() for s in r.new_specs] + list(new_specs)

        stranded = [r for r in waiting if not any(s.can_hold(r) for s in after)]
        if stranded:
            largest = max((s.max_input_len for s in after), default=0)
            ids = ", ".join(repr(r.request_id) for r in stranded[:8])
            more = f" and {len(stranded) - 8} more" if len(stranded) > 8 else ""
            raise StrandedRequests(
                f"{len(stranded)} waiting request(s) ({ids}{more}; up to "
                f"{max(r.input_len for r in stranded)} tokens) need a larger worker than any the "
                f"pool would have after this change (the largest would hold {largest} tokens)",
                stranded, largest)

    def open(self, kind: str, old_ids: Sequence[int], new_specs: Sequence[WorkerSpec],
             now: float) -> Reconfiguration:
        """Records a checked change (`check`) under the next epoch and returns it."""
        self.epoch += 1
        rec = Reconfiguration(kind, tuple(old_ids), tuple(new_specs), self.epoch, now)
        self.in_progress[rec.epoch] = rec
        return rec

    def involving(self, worker_id: int) -> list[Reconfiguration]:
        """The changes in progress that drain `worker_id`."""
        return [rec for rec in self.in_progress.values() if worker_id in rec.old_ids]

    def will_hold(self, request: Request) -> bool:
        """Whether a worker still being created (a change's new spec) can hold `request`."""
        return any(spec.can_hold(request)
                   for rec in self.in_progress.values() for spec in rec.new_specs)

    def abandon(self, epoch: int) -> Reconfiguration:
        """Gives up the change of `epoch` (a worker of it was lost,
        `serving.policy.membership`): it leaves `in_progress`, its new workers never appear,
        and a later `close(epoch)` returns None.

        Raises:
          ValueError: no change of that epoch is in progress.
        """
        rec = self.in_progress.pop(epoch, None)
        if rec is None:
            raise ValueError(f"no reconfiguration of epoch {epoch} is in progress")
        self.abandoned.add(epoch)
        return rec

    def close(self, epoch: int) -> Reconfiguration | None:
        """Removes and returns the change of `epoch`, which must be re-carving; None when that
        change was abandoned (`abandon`: the backend finished a change given up).

        Raises:
          ValueError: no change of that epoch is re-carving.
        """
        if epoch in self.abandoned:
            return None
        rec = self.in_progress.get(epoch)
        if rec is None or rec.recarve_started is None:
            raise ValueError(f"no reconfiguration of epoch {epoch} is re-carving")
        del self.in_progress[epoch]
        return rec

    def record(self, rec: Reconfiguration, now: float, composition: list[int]) -> None:
        """Appends a finished change to `log` and counts it in `finished`."""
        self.finished[rec.kind] += 1
        self.log.append({
            "epoch": rec.epoch, "kind": rec.kind, "old": list(rec.old_ids),
            "new": [s.worker_id for s in rec.new_specs], "started": rec.started,
            "drained": rec.recarve_started, "finished": now, "composition": composition})
