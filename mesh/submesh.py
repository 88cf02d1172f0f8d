"""Carving a worker's 1-D `cp` submesh out of a host's devices.

A worker of CP degree C owns the aligned device group `[k*C, (k+1)*C)` (buddy groups, so split
and merge keep alignment; see DESIGN.md "Devices, meshes and KV"). Rank r of the worker is
`devices[first_device + r]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np


def worker_mesh(devices: Sequence[jax.Device], first_device: int, cp_degree: int,
                axis: str = "cp") -> jax.sharding.Mesh:
    """The 1-D mesh `(axis,)` over `devices[first_device : first_device + cp_degree]`.

    Args:
      devices: the host's devices in pool order (e.g. `jax.devices()`).
      first_device: index of the worker's rank-0 device; a multiple of `cp_degree`.
      cp_degree: C, a power of two >= 1.
      axis: the mesh axis name.

    Raises:
      ValueError: for a CP degree that is not a power of two >= 1, a `first_device` that is
        negative or not a multiple of `cp_degree` (unaligned), or a group running past the end
        of `devices`.
    """
    n = len(devices)
    if not isinstance(cp_degree, int) or cp_degree < 1 or cp_degree & (cp_degree - 1):
        raise ValueError(f"cp_degree must be a power of two >= 1, got {cp_degree!r}")
    if first_device < 0 or first_device % cp_degree:
        raise ValueError(f"first_device must be a non-negative multiple of cp_degree="
                         f"{cp_degree} (aligned group), got {first_device}")
    if first_device + cp_degree > n:
        raise ValueError(f"devices [{first_device}, {first_device + cp_degree}) run past the "
                         f"{n} devices available")
    group = list(devices[first_device:first_device + cp_degree])
    return jax.sharding.Mesh(np.array(group, dtype=object), (axis,))
