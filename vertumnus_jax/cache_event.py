"""Plain data of the prefix cache: its events (vLLM's KV events) and its out-of-blocks error.

Re-exported by `vertumnus_jax.prefix_cache`.
"""

from __future__ import annotations

import dataclasses


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks on some rank even after evicting every unreferenced block."""


@dataclasses.dataclass(frozen=True)
class CacheEvent:
    """One change of the cache: `kind` "insert" (BlockStored) or "evict" (BlockRemoved).

    `parent_hash` is None for a block at depth 0; `rank` and `block_id` locate the KV block.
    """

    kind: str
    block_hash: int
    parent_hash: int | None
    rank: int
    block_id: int


@dataclasses.dataclass(frozen=True)
class CachedBlock:
    """One cached block (`PrefixCache.blocks`): its chained hash, parent hash (None at depth
    0), depth (block index in its sequences), rank (`depth % C`), physical block id, reference
    count and logical LRU tick of its last access."""

    block_hash: int
    parent_hash: int | None
    depth: int
    rank: int
    block_id: int
    ref: int
    last_access: int
