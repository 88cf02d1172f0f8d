"""The paged KV pool of one worker: fixed-size blocks on each of its C devices.

Per device (rank) the pool holds K and V as `[layers, num_blocks, block_size, kv_heads,
head_dim]` arrays, allocated once. The worker sees them as one global array per K and V of
shape `[C * layers, num_blocks, block_size, kv_heads, head_dim]` sharded over the `cp` axis on
dimension 0, so rank r's shard is exactly its device's pool. Writers (the prefill step,
`write_sequence`) take the arrays as donated jit arguments and return the updated ones, so the
update happens in place in the same device buffers.

Block striping: block i of a cached sequence lives on rank `i mod C` (at whatever block id the
allocator gave it there), so a prefix's blocks spread evenly over the ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vertumnus_jax.config import ModelConfig


@functools.cache
def _write_fn(mesh: jax.sharding.Mesh, axis: str):
    def local(k, v, dst, k_new, v_new):
        # k, v: [layers, num_blocks, bs, kvh, d]; dst: [1, J]; k_new: [1, layers, J, bs, kvh, d]
        k = k.at[:, dst[0]].set(k_new[0], mode="drop")
        v = v.at[:, dst[0]].set(v_new[0], mode="drop")
        return k, v

    spec = P(axis)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, spec),
                       check_vma=False)
    return jax.jit(fn, donate_argnums=(0, 1))


class KVPool:
    """K and V blocks of a worker's C devices.

    Args:
      mesh: the worker's 1-D mesh; its `axis` has C devices (ranks in mesh order).
      config: the model (layers, KV heads, head_dim, dtype).
      num_blocks: blocks per device, >= 1.
      block_size: tokens per block, a power of two >= 1.
      axis: the mesh axis name.
      buffers: optional `(ks, vs)`, per rank the existing single-device
        `[layers, num_blocks, block_size, kv_heads, head_dim]` K and V arrays on that rank's
        device (e.g. another pool's, after a split or merge). They are re-wrapped into the
        global arrays with `jax.make_array_from_single_device_arrays`: no copy, no zeroing.

    Attributes:
      k, v: `[C * layers, num_blocks, block_size, kv_heads, head_dim]` global arrays in the
        model's dtype, sharded over `axis` on dimension 0.

    Raises:
      ValueError: for `num_blocks < 1`, a block size that is not a power of two, or buffers
        that are not C per K and V of the device shape and dtype on the ranks' devices.
    """

    def __init__(self, mesh: jax.sharding.Mesh, config: ModelConfig, num_blocks: int,
                 block_size: int, axis: str = "cp", *,
                 buffers: tuple[Sequence[jax.Array], Sequence[jax.Array]] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")
        self.mesh, self.axis, self.config = mesh, axis, config
        self.cp_degree = int(mesh.shape[axis])
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.sharding = NamedSharding(mesh, P(axis))
        if buffers is not None:
            self.k, self.v = self._wrap(*buffers)
            return
        shape = (self.cp_degree * config.num_layers,) + self.device_shape[1:]
        zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(config.dtype)),
                        out_shardings=self.sharding)
        self.k, self.v = zeros(), zeros()

    def _wrap(self, ks: Sequence[jax.Array], vs: Sequence[jax.Array]
              ) -> tuple[jax.Array, jax.Array]:
        devices = list(self.mesh.devices.reshape(-1))
        want, dtype = self.device_shape, jnp.dtype(self.config.dtype)
        out = []
        for name, arrays in (("k", ks), ("v", vs)):
            arrays = list(arrays)
            if len(arrays) != self.cp_degree:
                raise ValueError(f"buffers: {name} must hold {self.cp_degree} per-rank arrays, "
                                 f"got {len(arrays)}")
            for r, (a, d) in enumerate(zip(arrays, devices)):
                if not isinstance(a, jax.Array) or a.shape != want or a.dtype != dtype or \
                        a.devices() != {d}:
                    raise ValueError(f"buffers: {name}[{r}] must be a {want} {dtype} array on "
                                     f"device {d.id}, got {getattr(a, 'shape', type(a))}")
            out.append(jax.make_array_from_single_device_arrays(
                (self.cp_degree * want[0],) + want[1:], self.sharding, arrays))
        return out[0], out[1]

    def device_buffers(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """Per rank, the rank's own K and V arrays (`rank_arrays`), as `(ks, vs)`."""
        pairs = [self.rank_arrays(r) for r in range(self.cp_degree)]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def replace_buffers(self, ks: Sequence[jax.Array], vs: Sequence[jax.Array]) -> None:
        """Adopts per-rank K and V arrays (checked as `buffers` in the constructor), re-wrapped
        without a copy (e.g. after in-place per-device block moves)."""
        self.k, self.v = self._wrap(ks, vs)

    @property
    def device_shape(self) -> tuple[int, int, int, int, int]:
        """`(layers, num_blocks, block_size, kv_heads, head_dim)` of each device's K (and V)."""
        c = self.config
        return (c.num_layers, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of K plus V on one device."""
        return 2 * int(np.prod(self.device_shape)) * jnp.dtype(self.config.dtype).itemsize

    def replace(self, k: jax.Array, v: jax.Array) -> None:
        """Adopts the arrays a donated update returned (same shape and sharding)."""
        if k.shape != self.k.shape or v.shape != self.v.shape:
            raise ValueError(f"k, v must have shape {self.k.shape}, got {k.shape}, {v.shape}")
        self.k, self.v = k, v

    def rank_arrays(self, rank: int) -> tuple[jax.Array, jax.Array]:
        """Rank `rank`'s own `[layers, num_blocks, bs, kvh, d]` K and V (single-device arrays)."""
        device = self.mesh.devices.reshape(-1)[rank]

        def pick(a):
            return next(s.data for s in a.addressable_shards if s.device == device)

        return pick(self.k), pick(self.v)

    def _check_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got "
                             f"[{ids.min()}, {ids.max()}]")
        return ids

    def read_sequence(self, block_ids: Sequence[int], first_index: int = 0
                      ) -> tuple[np.ndarray, np.ndarray]:
        """K and V of consecutive blocks of a sequence, gathered to the host.

        Args:
          block_ids: block k (sequence index `first_index + k`) is read from rank
            `(first_index + k) % C` at that block id.
          first_index: sequence index of the first block.

        Returns:
          `(k, v)` numpy `[layers, len(block_ids) * block_size, kv_heads, head_dim]`.

        Raises ValueError for a block id out of range.
        """
        ids = self._check_ids(block_ids)
        c = self.cp_degree
        layers, _, bs, kvh, d = self.device_shape
        dtype = np.dtype(self.k.dtype)
        k_out = np.empty((layers, len(ids), bs, kvh, d), dtype)
        v_out = np.empty_like(k_out)
        for r in range(c):  # gather each rank's blocks on its device, then copy only those
            where = [i for i in range(len(ids)) if (first_index + i) % c == r]
            if where:
                rk, rv = self.rank_arrays(r)
                k_out[:, where] = np.asarray(rk[:, ids[where]])
                v_out[:, where] = np.asarray(rv[:, ids[where]])
        return (k_out.reshape(layers, len(ids) * bs, kvh, d),
                v_out.reshape(layers, len(ids) * bs, kvh, d))

    def write_sequence(self, block_ids: Sequence[int], k: np.ndarray, v: np.ndarray,
                       first_index: int = 0) -> None:
        """Writes K and V of consecutive blocks of a sequence, in place (donated buffers).

        Args:
          block_ids: block k goes to rank `(first_index + k) % C` at that block id.
          k, v: `[layers, len(block_ids) * block_size, kv_heads, head_dim]`.
          first_index: sequence index of the first block.

        Raises ValueError for a block id out of range or a K/V shape other than the above.
        """
        ids = self._check_ids(block_ids)
        layers, nb, bs, kvh, d = self.device_shape
        want = (layers, len(ids) * bs, kvh, d)
        if np.shape(k) != want or np.shape(v) != want:
            raise ValueError(f"k and v must have shape {want}, got {np.shape(k)}, {np.shape(v)}")
        c = self.cp_degree
        j = max(1, -(-len(ids) // c))
        dst = np.full((c, j), nb, np.int32)  # id nb = dropped (no write)
        dtype = np.dtype(self.k.dtype)
        k_new = np.zeros((c, layers, j, bs, kvh, d), dtype)
        v_new = np.zeros_like(k_new)
        kb = np.asarray(k).reshape(layers, len(ids), bs, kvh, d)
        vb = np.asarray(v).reshape(layers, len(ids), bs, kvh, d)
        fill = [0] * c  # blocks placed so far per rank
        for i, b in enumerate(ids):
            r = (first_index + i) % c
            slot, fill[r] = fill[r], fill[r] + 1
            dst[r, slot] = b
            k_new[r, :, slot], v_new[r, :, slot] = kb[:, i], vb[:, i]
        dst, k_new, v_new = jax.device_put((dst, k_new, v_new), self.sharding)
        self.k, self.v = _write_fn(self.mesh, self.axis)(self.k, self.v, dst, k_new, v_new)
