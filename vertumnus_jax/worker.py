"""One CP worker: a submesh of C devices with the weights replicated, a KV pool and a prefix cache.

The worker is plain state; `vertumnus_jax.prefill` runs prefill on it. Compiled prefill
executables are kept per (device set, C, padded new-token bucket, cached-prefix bucket), and the
requests `prefill_request` returned and `release_request` has not yet retired are tracked in
`live_requests` (so a double or foreign release is rejected).
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


class Worker:
    """A worker of CP degree C = the size of `mesh`'s `axis`.

    Args:
      mesh: the worker's 1-D device mesh (`mesh.worker_mesh`); rank r = the r-th device.
      model: the model; its parameters are replicated onto every device of `mesh` (callers that
        already hold per-device replicas pass them placed with a replicated sharding on `mesh`,
        and `device_put` then moves nothing).
      num_blocks: KV blocks per device, >= 1.
      block_size: tokens per KV block, a power of two >= 1.
      axis: the mesh axis name of the CP dimension.
      block_sizes: tiling of the Pallas attention kernel (default: its per-backend default).
      interpret: Pallas interpret mode (default: exactly on CPU).
      min_bucket: smallest padded length of the uncached tokens, a power of two >= 1.

    Raises:
      ValueError: for a mesh without `axis`, or the pool/cache arguments out of range.
    """

    def __init__(self, mesh: jax.sharding.Mesh, model: Qwen3, *, num_blocks: int,
                 block_size: int, axis: str = "cp", block_sizes: BlockSizes | None = None,
                 interpret: bool | None = None, min_bucket: int = 16):
        if axis not in mesh.shape:
            raise ValueError(f"mesh must have axis {axis!r}, got axes {tuple(mesh.shape)}")
        if min_bucket < 1 or min_bucket & (min_bucket - 1):
            raise ValueError(f"min_bucket must be a power of two >= 1, got {min_bucket}")
        self.mesh, self.axis = mesh, axis
        self.cp_degree = int(mesh.shape[axis])
        self.config = model.config
        self.graphdef, state = nnx.split(model)
        self.params = jax.device_put(state, NamedSharding(mesh, P()))
        self.pool = KVPool(mesh, self.config, num_blocks, block_size, axis)
        self.cache = PrefixCache(num_blocks, self.cp_degree)
        self.block_size = int(block_size)
        self.block_sizes, self.interpret = block_sizes, interpret
        self.min_bucket = int(min_bucket)
        self.executables: dict[tuple, object] = {}
        # Live requests of `prefill_request`: request_id -> (locked hashes, held tail blocks).
        self.live_requests: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Ids of the worker's devices in rank order."""
        return tuple(int(d.id) for d in self.mesh.devices.reshape(-1))

    def replicated(self, x) -> jax.Array:
        """`x` placed on every device of the worker (replicated)."""
        return jax.device_put(x, NamedSharding(self.mesh, P()))

    def sharded(self, x) -> jax.Array:
        """`x` (leading dimension C) placed with row r on rank r."""
        return jax.device_put(x, NamedSharding(self.mesh, P(self.axis)))
