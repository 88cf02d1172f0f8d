"""One CP worker: a submesh of C devices with the weights replicated, a KV pool and a prefix cache.

The worker is plain state; `vertumnus_jax.prefill` runs prefill on it. Compiled prefill
executables are kept per (device set, C, padded new-token bucket, cached-prefix bucket), and the
requests `prefill_request` returned and `release_request` has not yet retired are tracked in
`live_requests` (so a double or foreign release is rejected).

A worker can be built without copying weights: from parameters already placed replicated on its
mesh (`params=`), e.g. assembled from per-device replicas (`Worker.from_replicas`), and can
adopt existing per-device KV buffers and a prefix cache (`kv_buffers=`, `cache=`): that is how
`vertumnus_jax.recarve` builds the workers of a split or merge. A worker replaced that way is
`retire`d: its pool, parameters and cache now belong to the new workers.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import BlockSizes
from vertumnus_jax.kv_pool import KVPool
from vertumnus_jax.model import Qwen3
from vertumnus_jax.prefix_cache import PrefixCache


def check_replicated_params(params, mesh: jax.sharding.Mesh) -> None:
    """Raises ValueError unless every leaf of `params` is a jax.Array replicated on exactly
    `mesh`'s devices."""
    devices = set(mesh.devices.reshape(-1))
    for i, leaf in enumerate(jax.tree_util.tree_leaves(params)):
        if not isinstance(leaf, jax.Array) or leaf.sharding.device_set != devices or \
                not leaf.sharding.is_fully_replicated:
            raise ValueError(f"params leaf {i} must be a jax.Array replicated on exactly the "
                             f"mesh's devices {sorted(d.id for d in devices)}, got "
                             f"{getattr(leaf, 'sharding', type(leaf).__name__)}")


class Worker:
    """A worker of CP degree C = the size of `mesh`'s `axis`.

    Args:
      mesh: the worker's 1-D device mesh (`mesh.worker_mesh`); rank r = the r-th device.
      model: the model (`Qwen3`), or its `nnx.GraphDef` when `params` is given. Without
        `params` its parameters are replicated onto every device of `mesh` with `device_put`.
      num_blocks: KV blocks per device, >= 1.
      block_size: tokens per KV block, a power of two >= 1.
      axis: the mesh axis name of the CP dimension.
      block_sizes: tiling of the Pallas attention kernel (default: its per-backend default).
      interpret: Pallas interpret mode (default: exactly on CPU).
      min_bucket: smallest padded length of the uncached tokens, a power of two >= 1.
      params: the model's parameter state already placed replicated on exactly `mesh`'s
        devices (e.g. `mesh.ParamReplicas.assemble(mesh)`); used as is, no `device_put`.
      kv_buffers: `(ks, vs)` per-rank single-device K/V pool arrays to adopt (no copy; see
        `KVPool`); default a zeroed pool.
      cache: a `PrefixCache(num_blocks, C)` describing `kv_buffers`' blocks; default empty.
      executables: a dict of compiled prefill steps to share (keys hold the device ids, so
        workers of the same model, block size and kernel options may share one); default new.

    Raises:
      ValueError: for a mesh without `axis`, the pool/cache arguments out of range, a GraphDef
        without `params`, params not replicated on exactly the mesh's devices, or a cache of
        another size or degree.
    """

    def __init__(self, mesh: jax.sharding.Mesh, model: Qwen3 | nnx.GraphDef, *, num_blocks: int,
                 block_size: int, axis: str = "cp", block_sizes: BlockSizes | None = None,
                 interpret: bool | None = None, min_bucket: int = 16, params=None,
                 kv_buffers=None, cache: PrefixCache | None = None,
                 executables: dict | None = None):
        if axis not in mesh.shape:
            raise ValueError(f"mesh must have axis {axis!r}, got axes {tuple(mesh.shape)}")
        if min_bucket < 1 or min_bucket & (min_bucket - 1):
            raise ValueError(f"min_bucket must be a power of two >= 1, got {min_bucket}")
        self.mesh, self.axis = mesh, axis
        self.cp_degree = int(mesh.shape[axis])
        if isinstance(model, nnx.Module):
            self.graphdef, state = nnx.split(model)
        elif params is None:
            raise ValueError("model must be a Qwen3 module unless params are given")
        else:
            self.graphdef, state = model, None
        if params is None:
            self._params = jax.device_put(state, NamedSharding(mesh, P()))
        else:
            check_replicated_params(params, mesh)
            self._params = params
        self.config = (model.config if isinstance(model, nnx.Module)
                       else nnx.merge(self.graphdef, params).config)
        self._pool = KVPool(mesh, self.config, num_blocks, block_size, axis, buffers=kv_buffers)
        if cache is None:
            cache = PrefixCache(num_blocks, self.cp_degree)
        elif not isinstance(cache, PrefixCache) or (cache.num_blocks, cache.cp_degree) != (
                num_blocks, self.cp_degree):
            raise ValueError(f"cache must be a PrefixCache({num_blocks}, {self.cp_degree}), got "
                             f"{getattr(cache, 'num_blocks', None)} blocks, degree "
                             f"{getattr(cache, 'cp_degree', None)}")
        self._cache = cache
        self.block_size = int(block_size)
        self.block_sizes, self.interpret = block_sizes, interpret
        self.min_bucket = int(min_bucket)
        self.executables: dict[tuple, object] = {} if executables is None else executables
        # Live requests of `prefill_request`: request_id -> (locked hashes, held tail blocks).
        self.live_requests: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.retired: str | None = None

    @classmethod
    def from_replicas(cls, mesh: jax.sharding.Mesh, model: Qwen3 | nnx.GraphDef, replicas, *,
                      num_blocks: int, block_size: int, **kwargs) -> Worker:
        """A worker whose parameters are `replicas.assemble(mesh)` (`mesh.ParamReplicas`):
        re-wrapped per-device buffers, zero weight bytes copied. `kwargs` as the constructor's.
        """
        return cls(mesh, model, num_blocks=num_blocks, block_size=block_size,
                   params=replicas.assemble(mesh), **kwargs)

    def _live(self, what):
        if self.retired is not None:
            raise RuntimeError(f"worker on devices {self.device_ids} was retired "
                               f"({self.retired}); use the workers that replaced it")
        return what

    @property
    def params(self):
        """The parameter state, replicated on the worker's devices (RuntimeError if retired)."""
        return self._live(self._params)

    @property
    def pool(self) -> KVPool:
        """The KV pool (RuntimeError if retired)."""
        return self._live(self._pool)

    @property
    def cache(self) -> PrefixCache:
        """The local prefix cache (RuntimeError if retired)."""
        return self._live(self._cache)

    def retire(self, reason: str) -> None:
        """Marks the worker replaced (split, merge): its pool, params and cache may no longer be
        used (their buffers now belong to other workers)."""
        self.retired = str(reason)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The worker's devices in rank order."""
        return tuple(self.mesh.devices.reshape(-1))

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Ids of the worker's devices in rank order."""
        return tuple(int(d.id) for d in self.mesh.devices.reshape(-1))

    def cached_hashes(self) -> tuple[int, ...]:
        """Block hashes in the worker's prefix cache, parents before children (what the
        scheduler's `finish_reconfiguration` wants per new worker)."""
        return tuple(b.block_hash for b in self.cache.blocks())

    def replicated(self, x) -> jax.Array:
        """`x` placed on every device of the worker (replicated)."""
        return jax.device_put(x, NamedSharding(self.mesh, P()))

    def sharded(self, x) -> jax.Array:
        """`x` (leading dimension C) placed with row r on rank r."""
        return jax.device_put(x, NamedSharding(self.mesh, P(self.axis)))
