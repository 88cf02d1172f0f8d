"""The two-phase change of a device pool: a split or merge begun, adopted only once ready.

`DevicePool.begin_split` / `begin_merge` return a `PendingChange` for a new epoch; the backend
re-carves, marks every rank of every new worker ready (`mark_ready` / `mark_worker_ready`), and
`DevicePool.commit` adopts the new groups only when `ready` (DESIGN.md "Devices, meshes and
KV"; Vertumnus paper section 6). Re-exported by `mesh.device_pool` and `mesh`.
"""

from __future__ import annotations

import dataclasses

from mesh.device_group import DeviceGroup


@dataclasses.dataclass(eq=False)
class PendingChange:
    """A split or merge begun but not committed.

    Attributes:
      kind: "split" or "merge".
      epoch: the epoch the new groups will be adopted under.
      old_ids: the worker ids being replaced (reserved until commit or abort).
      new_groups: the groups replacing them, in device order.
    """

    kind: str
    epoch: int
    old_ids: tuple[int, ...]
    new_groups: tuple[DeviceGroup, ...]
    _ready: dict[int, set[int]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def new_ids(self) -> tuple[int, ...]:
        """Ids of the new workers, device order."""
        return tuple(g.worker_id for g in self.new_groups)

    def _group(self, worker_id: int) -> DeviceGroup:
        for g in self.new_groups:
            if g.worker_id == worker_id:
                return g
        raise ValueError(f"worker_id must be one of the new workers {self.new_ids}, got "
                         f"{worker_id!r}")

    def mark_ready(self, worker_id: int, rank: int) -> None:
        """Records that rank `rank` of new worker `worker_id` has adopted the new geometry.

        Raises ValueError for a worker that is not one of `new_ids` or a rank outside
        `[0, cp_degree)`.
        """
        c = self._group(worker_id).cp_degree
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < c:
            raise ValueError(f"rank must be in [0, {c}) for worker {worker_id}, got {rank!r}")
        self._ready.setdefault(worker_id, set()).add(rank)

    def mark_worker_ready(self, worker_id: int) -> None:
        """`mark_ready` for every rank of new worker `worker_id`."""
        for r in range(self._group(worker_id).cp_degree):
            self.mark_ready(worker_id, r)

    def missing_ranks(self) -> dict[int, tuple[int, ...]]:
        """Per new worker id, the ranks not yet ready (workers with none missing omitted)."""
        out = {}
        for g in self.new_groups:
            miss = tuple(r for r in range(g.cp_degree) if r not in self._ready.get(g.worker_id,
                                                                                   ()))
            if miss:
                out[g.worker_id] = miss
        return out

    @property
    def ready(self) -> bool:
        """Whether every rank of every new worker is ready."""
        return not self.missing_ranks()
