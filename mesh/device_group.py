"""`DeviceGroup`: one CP worker's aligned devices in a host's pool.

The plain value shared by `mesh.device_pool` (which owns the groups) and `mesh.pending_change`
(a split or merge in progress); it lives below both so that neither imports the other.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """One worker's devices: pool indices `[first_device, first_device + cp_degree)`.

    Attributes:
      worker_id: the worker's id (an int >= 0, unique in the pool).
      first_device: index of its rank-0 device in the pool's devices; a multiple of cp_degree.
      cp_degree: C, a power of two >= 1.
      epoch: the epoch under which the group was adopted (0 for the initial composition).
    """

    worker_id: int
    first_device: int
    cp_degree: int
    epoch: int

    @property
    def device_indices(self) -> range:
        """Pool indices of the worker's devices, rank order."""
        return range(self.first_device, self.first_device + self.cp_degree)

    def is_buddy_of(self, other: DeviceGroup) -> bool:
        """Whether `self` and `other` are the two aligned halves of one group of twice the
        degree."""
        c = self.cp_degree
        lo = min(self.first_device, other.first_device)
        return (other.cp_degree == c and lo % (2 * c) == 0
                and abs(self.first_device - other.first_device) == c)
