"""A host's device pool: CP workers as aligned power-of-two device groups; split and merge.

A composition such as `[4, 2, 2]` lists the workers' CP degrees in device order. A worker of
degree C occupies the aligned group `[k*C, (k+1)*C)` of the pool's devices. A split turns a 2C
worker into its two aligned halves; a merge turns two buddy C workers (the halves of one
aligned 2C group) into that group. Every composition of the same devices is reachable this way
(DESIGN.md "Devices, meshes and KV"; Vertumnus paper section 6).

A change is two-phase: `begin_split` / `begin_merge` reserve the old workers and return a
`PendingChange` for a new epoch; the backend re-carves, marks every rank of every new worker
ready (`PendingChange.mark_ready`), and `commit` then adopts the new groups under that epoch
(or `abort` drops the change; `PendingChange` is in `mesh.pending_change`). Until the commit
the old groups stay the pool's groups.

Every invalid composition or operation raises `ValueError` saying why, with nothing changed.
Imports only jax (and `mesh.submesh`, `mesh.device_group`, `mesh.pending_change`).
"""

from __future__ import annotations

import itertools
import numbers
import operator
from collections.abc import Sequence

import jax

from mesh.device_group import DeviceGroup
from mesh.pending_change import PendingChange
from mesh.submesh import worker_mesh

__all__ = ["DeviceGroup", "DevicePool", "PendingChange", "check_composition"]


def _is_pow2(c) -> bool:
    if isinstance(c, bool) or not hasattr(c, "__index__"):  # ints and numpy integers
        return False
    c = operator.index(c)
    return c >= 1 and not c & (c - 1)


def check_composition(composition: Sequence[int], num_devices: int) -> None:
    """Checks that `composition` (CP degrees in device order) tiles a prefix of the devices.

    Raises:
      ValueError: for an empty composition, a degree that is not a power of two >= 1, a worker
        whose first device is not a multiple of its degree (unaligned), or more devices than
        `num_devices` in all.
    """
    comp = list(composition)
    if not comp:
        raise ValueError("composition must list at least one CP degree")
    first = 0
    for k, c in enumerate(comp):
        if not _is_pow2(c):
            raise ValueError(f"composition[{k}] must be a power of two >= 1, got {c!r}")
        if first % c:
            raise ValueError(f"composition[{k}] = {c} starts at device {first}, which is not a "
                             f"multiple of {c} (unaligned); composition {comp}")
        first += c
    if first > num_devices:
        raise ValueError(f"composition {comp} needs {first} devices, only {num_devices} exist")


class DevicePool:
    """The CP workers of one host as aligned device groups.

    Args:
      devices: the host's devices in pool order (e.g. `jax.devices()`).
      composition: CP degrees of the initial workers in device order; they occupy the first
        `sum(composition)` devices (`check_composition`).
      axis: the mesh axis name of the workers' meshes.
      worker_ids: ids of the initial workers (default `0 .. len(composition) - 1`): distinct
        ints >= 0.

    Raises:
      ValueError: for an invalid composition (`check_composition`) or bad worker ids.
    """

    def __init__(self, devices: Sequence[jax.Device], composition: Sequence[int],
                 axis: str = "cp", *, worker_ids: Sequence[int] | None = None):
        self._devices = tuple(devices)
        if len(set(self._devices)) != len(self._devices):
            raise ValueError(f"devices must be distinct, got {len(self._devices)} entries for "
                             f"{len(set(self._devices))} devices")
        check_composition(composition, len(self._devices))
        comp = [int(c) for c in composition]
        ids = list(range(len(comp))) if worker_ids is None else list(worker_ids)
        if len(ids) != len(comp) or len(set(ids)) != len(ids) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"worker_ids must be {len(comp)} distinct ints >= 0, got {ids!r}")
        self.axis = axis
        self._groups: dict[int, DeviceGroup] = {}
        first = 0
        for wid, c in zip(ids, comp):
            self._groups[wid] = DeviceGroup(wid, first, c, 0)
            first += c
        self._busy: set[int] = set()
        self._draining: set[int] = set()
        self._pending: dict[int, PendingChange] = {}  # epoch -> change
        self._next_id = max(ids) + 1
        self._last_epoch = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The host's devices in pool order (the groups cover the first `num_devices_used`)."""
        return self._devices

    @property
    def groups(self) -> list[DeviceGroup]:
        """The adopted (committed) groups, in device order."""
        return sorted(self._groups.values(), key=lambda g: g.first_device)

    @property
    def composition(self) -> list[int]:
        """CP degrees of the adopted groups in device order."""
        return [g.cp_degree for g in self.groups]

    @property
    def num_devices_used(self) -> int:
        """Devices covered by the groups: `sum(composition)` (constant across changes)."""
        return sum(self.composition)

    @property
    def epoch(self) -> int:
        """The latest epoch begun (a pending change's) or adopted."""
        return self._last_epoch

    @property
    def pending(self) -> tuple[PendingChange, ...]:
        """Changes begun and neither committed nor aborted, by epoch."""
        return tuple(self._pending[e] for e in sorted(self._pending))

    def group(self, worker_id: int) -> DeviceGroup:
        """The adopted group of `worker_id`. Raises ValueError for an unknown id."""
        g = self._groups.get(worker_id)
        if g is None:
            raise ValueError(f"worker_id {worker_id!r} is not a worker of the pool (workers "
                             f"{sorted(self._groups)})")
        return g

    def mesh(self, worker_id: int) -> jax.sharding.Mesh:
        """The 1-D `(axis,)` mesh of an adopted worker or of a new worker of a pending change
        (`mesh.worker_mesh`). Raises ValueError for an unknown id."""
        g = self._groups.get(worker_id)
        if g is None:
            g = next((n for ch in self._pending.values() for n in ch.new_groups
                      if n.worker_id == worker_id), None)
        if g is None:
            raise ValueError(f"worker_id {worker_id!r} is neither a worker of the pool nor a "
                             "new worker of a pending change")
        return worker_mesh(self._devices, g.first_device, g.cp_degree, self.axis)

    def _reserved(self) -> set[int]:
        return {w for ch in self._pending.values() for w in ch.old_ids}

    def _free(self, wid: int) -> bool:
        return wid not in self._busy and wid not in self._draining

    def legal_splits(self, *, idle_only: bool = False) -> list[int]:
        """Ids of workers that may split: degree >= 2 and not in a pending change (with
        `idle_only`, also neither busy nor draining). Device order."""
        reserved = self._reserved()
        return [g.worker_id for g in self.groups if g.cp_degree >= 2
                and g.worker_id not in reserved and (not idle_only or self._free(g.worker_id))]

    def legal_merges(self, *, idle_only: bool = False) -> list[tuple[int, int]]:
        """`(lower_id, upper_id)` buddy pairs that may merge, neither in a pending change (with
        `idle_only`, also neither busy nor draining). Device order."""
        reserved = self._reserved()
        gs, out = self.groups, []
        for a, b in itertools.pairwise(gs):
            if a.is_buddy_of(b) and not {a.worker_id, b.worker_id} & reserved and (
                    not idle_only or (self._free(a.worker_id) and self._free(b.worker_id))):
                out.append((a.worker_id, b.worker_id))
        return out

    # ---- worker state ----------------------------------------------------------------------------
    def mark_busy(self, worker_id: int, busy: bool = True) -> None:
        """Marks a worker as running a prefill (or not). A busy worker cannot split or merge.

        Raises ValueError for an unknown id, or marking busy a worker in a pending change.
        """
        self._mark(self._busy, worker_id, busy, "run prefill")

    def mark_draining(self, worker_id: int, draining: bool = True) -> None:
        """Marks a worker as draining (no new placements, in-flight work finishing) or clears
        it once the drain is over. A draining worker cannot split or merge.

        Raises ValueError for an unknown id, or marking draining a worker in a pending change.
        """
        self._mark(self._draining, worker_id, draining, "start draining")

    def _mark(self, marks: set[int], worker_id: int, on: bool, what: str) -> None:
        self.group(worker_id)
        if on and worker_id in self._reserved():
            raise ValueError(f"worker {worker_id} is being re-carved (pending change); it cannot "
                             f"{what}")
        (marks.add if on else marks.discard)(worker_id)

    def is_busy(self, worker_id: int) -> bool:
        """Whether `worker_id` is marked busy."""
        return self.group(worker_id).worker_id in self._busy

    def is_draining(self, worker_id: int) -> bool:
        """Whether `worker_id` is marked draining."""
        return self.group(worker_id).worker_id in self._draining

    # ---- changes ---------------------------------------------------------------------------------
    def _check_old(self, wid: int) -> DeviceGroup:
        g = self.group(wid)
        if wid in self._busy:
            raise ValueError(f"worker {wid} is busy (prefill in flight); drain it first")
        if wid in self._draining:
            raise ValueError(f"worker {wid} is draining; re-carve it once the drain is over")
        if wid in self._reserved():
            raise ValueError(f"worker {wid} is already in a pending change")
        return g

    def _new_ids(self, new_ids, n: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + n)) if new_ids is None else list(new_ids)
        taken = set(self._groups) | {w for ch in self._pending.values() for w in ch.new_ids}
        if len(ids) != n or len(set(ids)) != n or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"new ids must be {n} distinct ints >= 0, got {new_ids!r}")
        if taken & set(ids):
            raise ValueError(f"new ids {sorted(taken & set(ids))} are already in use")
        return ids

    def _new_epoch(self, epoch) -> int:
        if epoch is None:
            return self._last_epoch + 1
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch <= self._last_epoch:
            raise ValueError(f"epoch must be an int > {self._last_epoch} (the latest epoch), "
                             f"got {epoch!r}")
        return epoch

    def _register(self, kind, old_ids, new_groups, ids, epoch) -> PendingChange:
        change = PendingChange(kind, epoch, tuple(old_ids), tuple(new_groups))
        self._pending[epoch] = change
        self._next_id = max(self._next_id, max(ids) + 1)
        self._last_epoch = epoch
        return change

    def begin_split(self, worker_id: int, new_ids: Sequence[int] | None = None, *,
                    epoch: int | None = None, parts: Sequence[int] | None = None
                    ) -> PendingChange:
        """Begins splitting a worker: into its two aligned halves, or with `parts` into the
        groups repeated halving makes, in one change.

        Args:
          worker_id: an adopted worker of degree >= 2, neither busy, draining nor pending.
          new_ids: ids of the new groups in device order; default fresh ids.
          epoch: the new epoch (default the latest + 1); larger than every epoch so far.
          parts: the new groups' CP degrees in device order: two or more powers of two summing
            to the worker's degree, each starting at a multiple of itself from its first
            device (e.g. [2, 2, 4] of an 8); default its two halves.

        Raises:
          ValueError: (nothing changed) unknown id, degree 1, busy, draining or pending worker,
            parts that repeated halving does not make, bad or used new ids, or a bad epoch.
        """
        g = self._check_old(worker_id)
        if g.cp_degree < 2:
            raise ValueError(f"worker {worker_id} has CP degree 1 and cannot split")
        parts = [g.cp_degree // 2] * 2 if parts is None else list(parts)
        at = 0
        for c in parts:  # (an aligned tiling: `serving.policy.worker.is_aligned_tiling`)
            if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1 or \
                    c & (c - 1) or at % c:
                at = -1
                break
            at += c
        if at != g.cp_degree or len(parts) < 2:
            raise ValueError(f"parts must be two or more CP degrees that halving worker "
                             f"{worker_id} (degree {g.cp_degree}) makes, in device order, got "
                             f"{parts}")
        parts = [int(c) for c in parts]  # (numpy integers as int)
        ids = self._new_ids(new_ids, len(parts))
        e = self._new_epoch(epoch)
        news, at = [], g.first_device
        for wid, c in zip(ids, parts):
            news.append(DeviceGroup(wid, at, c, e))
            at += c
        return self._register("split", [worker_id], news, ids, e)

    def begin_merge(self, a_id: int, b_id: int, new_id: int | None = None, *,
                    epoch: int | None = None) -> PendingChange:
        """Begins merging two buddy C workers into their aligned 2C group.

        Args:
          a_id, b_id: adopted workers of the same degree C whose groups are the two halves of
            one aligned group of 2C devices (any order); neither busy, draining nor pending.
          new_id: id of the merged worker; default a fresh id.
          epoch: as in `begin_split`.

        Raises:
          ValueError: (nothing changed) unknown or equal ids, busy, draining or pending workers,
            workers that are not buddies (different degrees or not one aligned 2C group), a bad
            or used new id, or a bad epoch.
        """
        if a_id == b_id:
            raise ValueError(f"cannot merge worker {a_id} with itself")
        ga, gb = self._check_old(a_id), self._check_old(b_id)
        if ga.cp_degree != gb.cp_degree:
            raise ValueError(f"workers {a_id} and {b_id} are not buddies: CP degrees "
                             f"{ga.cp_degree} and {gb.cp_degree} differ")
        if not ga.is_buddy_of(gb):
            raise ValueError(
                f"workers {a_id} (devices {ga.first_device}..{ga.first_device + ga.cp_degree - 1}"
                f") and {b_id} (devices {gb.first_device}..{gb.first_device + gb.cp_degree - 1})"
                f" are not buddies: not the two halves of one aligned group of "
                f"{2 * ga.cp_degree}")
        ids = self._new_ids(None if new_id is None else [new_id], 1)
        e = self._new_epoch(epoch)
        lo, hi = sorted((ga, gb), key=lambda g: g.first_device)
        new = DeviceGroup(ids[0], lo.first_device, 2 * lo.cp_degree, e)
        return self._register("merge", [lo.worker_id, hi.worker_id], [new], ids, e)

    def _pending_or_raise(self, change: PendingChange) -> None:
        if self._pending.get(getattr(change, "epoch", None)) is not change:
            raise ValueError("change is not a pending change of this pool (already committed, "
                             "aborted, or from another pool)")

    def commit(self, change: PendingChange) -> list[DeviceGroup]:
        """Adopts the new groups of `change` under its epoch; the old workers leave the pool.

        Returns the new groups. Raises ValueError (nothing changed) when `change` is not pending
        in this pool, or some rank of a new worker is not ready (naming them).
        """
        self._pending_or_raise(change)
        missing = change.missing_ranks()
        if missing:
            raise ValueError(f"cannot adopt epoch {change.epoch}: ranks not ready "
                             f"{ {w: list(r) for w, r in missing.items()} } (worker: ranks)")
        for wid in change.old_ids:
            del self._groups[wid]
        for g in change.new_groups:
            self._groups[g.worker_id] = g
        del self._pending[change.epoch]
        return list(change.new_groups)

    def abort(self, change: PendingChange) -> None:
        """Drops a pending change; the old workers stay as they are.

        Raises ValueError when `change` is not pending in this pool.
        """
        self._pending_or_raise(change)
        del self._pending[change.epoch]
