"""Prefix copies between workers that share no process: export to host memory, import.

`replicate_prefix` (`vertumnus_jax.recarve`) copies between two workers of one process with a
device-to-device `jax.device_put`. Across hosts the blocks travel through the runtime (Ray's
object store, `serving.ray_backend`): the source exports them as host arrays in natural token
order (`export_prefix`), the destination imports them re-striped to its own degree
(`import_prefix`). The result is the same cache state as `replicate_prefix` gives (tests check
it block for block).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from vertumnus_jax.kv_move import block_bytes
from vertumnus_jax.recarve import ReplicationResult, _as_chain, _take_events
from vertumnus_jax.worker import Worker


def _live(worker, name: str) -> None:
    if not isinstance(worker, Worker) or worker.retired is not None:
        raise ValueError(f"{name} must be a live Worker")


def export_prefix(src: Worker, block_hashes: Sequence[int], start: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """K and V of the cached prefix's blocks `start..` as host arrays.

    Args:
      src: a live worker caching every block of `block_hashes`.
      block_hashes: chained block hashes from the root.
      start: the first block to export (the destination holds the ones before).

    Returns:
      `(k, v)` numpy `[layers, (len(block_hashes) - start) * block_size, kv_heads, head_dim]`.

    Raises:
      ValueError: a retired worker, an empty chain, `start` out of `[0, len)`, or src not
        holding the whole chain.
    """
    chain = _as_chain(block_hashes)
    _live(src, "src")
    if not 0 <= start < len(chain):
        raise ValueError(f"start must be in [0, {len(chain)}), got {start}")
    ids = src.cache.match(chain, touch=False)
    if len(ids) != len(chain):
        raise ValueError(f"src holds only {len(ids)} of the {len(chain)} blocks")
    return src.pool.read_sequence(ids[start:], first_index=start)


def import_prefix(dst: Worker, block_hashes: Sequence[int], start: int, k: np.ndarray,
                  v: np.ndarray, *, consume_events: bool = True) -> ReplicationResult:
    """Writes exported blocks `start..` of a prefix into `dst` and caches the whole chain.

    dst must hold the chain's first `start` blocks already (it may hold more: those are kept and
    the exported copies of them skipped). Room is made by LRU eviction of dst's unreferenced
    blocks; the blocks enter dst's cache only once written.

    Args:
      dst: a live worker of the model and block size the KV came from.
      block_hashes: chained block hashes from the root.
      start: index of the first exported block.
      k, v: `export_prefix`'s arrays.
      consume_events: take this import's insert/evict events out of `dst.cache.events`.

    Returns:
      A `ReplicationResult` (inserted and evicted hashes, blocks and bytes copied, seconds).

    Raises:
      ValueError: (nothing changed) a retired worker, an empty chain, dst lacking one of the
        first `start` blocks, K/V of the wrong shape, or hashes that are not a chain in dst.
      OutOfBlocksError: (nothing changed) dst cannot hold the missing blocks.
    """
    t0 = time.perf_counter()
    chain = _as_chain(block_hashes)
    _live(dst, "dst")
    bs = dst.block_size
    cfg = dst.config
    want = (cfg.num_layers, (len(chain) - start) * bs, cfg.num_kv_heads, cfg.head_dim)
    if np.shape(k) != want or np.shape(v) != want:
        raise ValueError(f"k and v must have shape {want}, got {np.shape(k)}, {np.shape(v)}")
    cache = dst.cache
    cache.validate_chain(chain)
    have = cache.match(chain, touch=False)
    if len(have) < start:
        raise ValueError(f"dst holds {len(have)} leading blocks of the chain, fewer than "
                         f"start={start}")
    n_have, n, n_events = len(have), len(chain), len(cache.events)
    skip = (n_have - start) * bs
    with cache.transaction():
        cache.lock(chain[:n_have])
        new_ids = cache.allocate(n_have, n - n_have)
        if new_ids:
            dst.pool.write_sequence(new_ids, np.asarray(k)[:, skip:], np.asarray(v)[:, skip:],
                                    first_index=n_have)
        cache.insert(chain, have + new_ids)
        cache.unlock(chain[:n_have])
    jax.block_until_ready((dst.pool.k, dst.pool.v))
    inserted, evicted = _take_events(cache, n_events, consume_events)
    nbytes = block_bytes(cfg, bs)
    return ReplicationResult(inserted, evicted, n - n_have, (n - n_have) * nbytes,
                             time.perf_counter() - t0)
