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
from collections.abc import Mapping, Sequence

from serving.policy.request import Request
from serving.policy.worker import WorkerSpec, WorkerState, WorkerStatus, are_buddies


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


class Reconfigurations:
    """The pool's epochs, fresh worker ids, splits and merges in progress, and their log.

    Args:
      next_worker_id: the first id `new_worker_ids` hands out (above every initial worker's).

    Attributes:
      epoch: the latest epoch (0 for the initial workers; each change opens the next one).
      in_progress: the changes not finished yet, by epoch.
      log: one dict per finished change (epoch, kind, old and new ids, started, drained,
        finished, composition after it), in finishing order.
    """

    def __init__(self, next_worker_id: int) -> None:
        self.epoch = 0
        self.in_progress: dict[int, Reconfiguration] = {}
        self.log: list[dict] = []
        self._next_worker_id = next_worker_id

    def new_worker_ids(self, n: int) -> tuple[int, ...]:
        """`n` fresh worker ids (never reused)."""
        ids = tuple(range(self._next_worker_id, self._next_worker_id + n))
        self._next_worker_id += n
        return ids

    def check(self, kind: str, old_ids: Sequence[int], new_specs: Sequence[WorkerSpec],
              workers: Mapping[int, WorkerState]) -> list[WorkerState]:
        """Checks that replacing `old_ids` by `new_specs` is a legal `kind` change of `workers`.

        Returns:
          The old workers, in `old_ids` order.

        Raises:
          ValueError: an unknown kind; old ids that are repeated, unknown or not ACTIVE; new
            ids that are repeated or already used; or a shape that is not a split (one worker
            of degree 2C into its two aligned halves) or a merge (two buddy workers of degree C
            into their aligned group of 2C), devices and KV blocks per device conserved.
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
        taken = set(workers) | {s.worker_id for r in self.in_progress.values()
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
        need = -(-request.input_len // request.block_size)
        return any(request.input_len <= spec.max_input_len and need <= spec.kv_capacity_blocks
                   for rec in self.in_progress.values() for spec in rec.new_specs)

    def close(self, epoch: int) -> Reconfiguration:
        """Removes and returns the change of `epoch`, which must be re-carving.

        Raises:
          ValueError: no change of that epoch is re-carving.
        """
        rec = self.in_progress.get(epoch)
        if rec is None or rec.recarve_started is None:
            raise ValueError(f"no reconfiguration of epoch {epoch} is re-carving")
        del self.in_progress[epoch]
        return rec

    def record(self, rec: Reconfiguration, now: float, composition: list[int]) -> None:
        """Appends a finished change to `log`."""
        self.log.append({
            "epoch": rec.epoch, "kind": rec.kind, "old": list(rec.old_ids),
            "new": [s.worker_id for s in rec.new_specs], "started": rec.started,
            "drained": rec.recarve_started, "finished": now, "composition": composition})
