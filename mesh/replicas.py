"""One weight replica per device, re-wrapped (never copied) into any worker's replicated arrays.

The weights are placed once: `ParamReplicas(tree, devices)` does one `jax.device_put` per
device per leaf. A worker's parameter tree on its submesh is then *assembled* from those
per-device buffers with `jax.make_array_from_single_device_arrays` and
`NamedSharding(mesh, P())` (replicated): zero bytes move, so split and merge re-wrap the same
buffers (DESIGN.md "Devices, meshes and KV"). Tests compare `unsafe_buffer_pointer()` per leaf
per device (`buffer_pointers`). Imports only jax.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _mesh_devices(mesh: jax.sharding.Mesh) -> list[jax.Device]:
    return list(mesh.devices.reshape(-1))


def buffer_pointers(tree) -> dict[int, tuple[int, ...]]:
    """Per device id, the `unsafe_buffer_pointer()` of every leaf's shard on that device (leaf
    order of `jax.tree_util.tree_leaves(tree)`); leaves must be `jax.Array`s."""
    out: dict[int, list[int]] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for s in leaf.addressable_shards:
            out.setdefault(int(s.device.id), []).append(s.data.unsafe_buffer_pointer())
    return {d: tuple(p) for d, p in sorted(out.items())}


def shard_bytes(tree) -> dict[int, tuple[int, ...]]:
    """Per device id, the bytes of every leaf's shard on that device (order as
    `buffer_pointers`)."""
    out: dict[int, list[int]] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for s in leaf.addressable_shards:
            out.setdefault(int(s.device.id), []).append(int(s.data.nbytes))
    return {d: tuple(b) for d, b in sorted(out.items())}


class ParamReplicas:
    """A pytree of parameters with one full copy on each of a set of devices.

    Args:
      tree: a pytree of arrays (numpy or jax, e.g. the `nnx.State` of `nnx.split(model)`).
      devices: the devices to hold a replica (distinct, at least one).

    Each leaf is placed with one `jax.device_put(leaf, device)` per device (a leaf already on
    that device is not copied). This is the only weight copy of the serving process.

    Raises:
      ValueError: for no devices, repeated devices, or a leaf without shape and dtype.
    """

    def __init__(self, tree, devices: Sequence[jax.Device]):
        devices = tuple(devices)
        if not devices or len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct and at least one, got {devices!r}")
        leaves, self.treedef = jax.tree_util.tree_flatten(tree)
        for i, leaf in enumerate(leaves):
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                raise ValueError(f"leaf {i} of tree must be an array, got {type(leaf).__name__}")
        self._devices = devices
        self._buffers = [{d: jax.device_put(leaf, d) for d in devices} for leaf in leaves]

    @classmethod
    def from_replicated(cls, *trees) -> ParamReplicas:
        """Replicas built from the per-device shards of already placed, fully replicated trees
        (e.g. the parameters of the workers being split or merged): no `device_put`, no copy.

        Args:
          trees: pytrees of the same structure whose leaves are fully replicated `jax.Array`s
            of equal shapes and dtypes; a device present in several trees takes the first's.

        Raises:
          ValueError: for no trees, different structures, a leaf that is not a fully
            replicated jax.Array, different shapes or dtypes, or leaves on different device
            sets.
        """
        if not trees:
            raise ValueError("from_replicated needs at least one tree")
        flat = [jax.tree_util.tree_flatten(t) for t in trees]
        treedef = flat[0][1]
        if any(td != treedef for _, td in flat[1:]):
            raise ValueError("trees must have the same structure")
        buffers = []
        for i, leaves in enumerate(zip(*(f[0] for f in flat))):
            by_device: dict[jax.Device, jax.Array] = {}
            for leaf in leaves:
                if not isinstance(leaf, jax.Array) or not leaf.sharding.is_fully_replicated:
                    raise ValueError(f"leaf {i} must be a fully replicated jax.Array, got "
                                     f"{type(leaf).__name__}")
                if (leaf.shape, leaf.dtype) != (leaves[0].shape, leaves[0].dtype):
                    raise ValueError(f"leaf {i}: shapes/dtypes differ across trees: "
                                     f"{leaves[0].shape} {leaves[0].dtype} vs {leaf.shape} "
                                     f"{leaf.dtype}")
                for s in leaf.addressable_shards:
                    by_device.setdefault(s.device, s.data)
            buffers.append(by_device)
        devices = tuple(sorted(buffers[0], key=lambda d: d.id)) if buffers else ()
        if any(set(b) != set(devices) for b in buffers):
            raise ValueError("leaves of the trees are placed on different device sets")
        self = cls.__new__(cls)
        self.treedef, self._devices, self._buffers = treedef, devices, buffers
        return self

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Devices holding a replica."""
        return self._devices

    @property
    def nbytes_per_device(self) -> int:
        """Bytes of one replica (all leaves on one device)."""
        return sum(int(next(iter(b.values())).nbytes) for b in self._buffers)

    def buffer_pointers(self, device: jax.Device) -> tuple[int, ...]:
        """`unsafe_buffer_pointer()` of every leaf's buffer on `device`, leaf order.

        Raises ValueError for a device without a replica."""
        self._check_devices([device])
        return tuple(b[device].unsafe_buffer_pointer() for b in self._buffers)

    def _check_devices(self, devices) -> None:
        missing = [d.id for d in devices if d not in set(self._devices)]
        if missing:
            raise ValueError(f"devices {missing} hold no replica (replicas on "
                             f"{[d.id for d in self._devices]})")

    def assemble(self, mesh: jax.sharding.Mesh):
        """The parameter tree on `mesh`, replicated (`NamedSharding(mesh, P())`), built from the
        existing per-device buffers with `jax.make_array_from_single_device_arrays`: zero bytes
        move (the per-device buffer pointers are the replicas').

        Returns a pytree of the original structure whose leaves are global `jax.Array`s.

        Raises ValueError when a device of `mesh` holds no replica.
        """
        devices = _mesh_devices(mesh)
        self._check_devices(devices)
        sharding = NamedSharding(mesh, P())
        leaves = []
        for b in self._buffers:
            first = b[devices[0]]
            leaves.append(jax.make_array_from_single_device_arrays(
                first.shape, sharding, [b[d] for d in devices]))
        return jax.tree_util.tree_unflatten(self.treedef, leaves)
