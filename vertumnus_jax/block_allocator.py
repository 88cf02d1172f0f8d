"""Per-rank KV block allocator of a worker's prefix cache.

Under block striping block i of a sequence lives on rank `i mod C`, so the allocator keeps one
free list per rank (a set, plus a lazy min-heap so the lowest free id goes first). Each block
id of a rank is in exactly one of three states:

- free;
- held by a caller (`take`n, not yet `give`n back or `adopt`ed by the tree);
- owned by the tree (a cached block, `adopt`ed; only `release` frees it, on eviction).

Every change is recorded in the cache's `UndoJournal`, so a failed transaction of the cache
puts the block states back (the heaps are then rebuilt with `rebuild_heaps`). Used by
`vertumnus_jax.prefix_cache.PrefixCache`, which does the eviction.

Source: SGLang's token-to-KV pool free lists; vLLM v1 block pool (free, in use, cached).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Mapping, Sequence

from vertumnus_jax.cache_event import OutOfBlocksError
from vertumnus_jax.undo_journal import UndoJournal


def rank_demand(first_index: int, count: int, cp_degree: int) -> collections.Counter:
    """Blocks needed per rank for sequence indices `first_index .. first_index + count - 1`
    (block i on rank `i % cp_degree`). Raises ValueError for a negative index or count."""
    if first_index < 0 or count < 0:
        raise ValueError(f"first_index and count must be >= 0, got {first_index}, {count}")
    return collections.Counter((first_index + k) % cp_degree for k in range(count))


class BlockAllocator:
    """Free lists, caller-held blocks and tree-owned blocks of `cp_degree` ranks.

    Args:
      num_blocks: KV blocks per rank (block ids `0 .. num_blocks - 1`), >= 1.
      cp_degree: ranks C, >= 1.
      journal: where every change logs its inverse (the cache's transaction journal).

    Ranks are not range-checked (callers pass `i % C`); block ids are, where a caller names one.
    Raises ValueError for `num_blocks < 1` or `cp_degree < 1`.
    """

    def __init__(self, num_blocks: int, cp_degree: int, journal: UndoJournal):
        if num_blocks < 1 or cp_degree < 1:
            raise ValueError(f"num_blocks and cp_degree must be >= 1, got {num_blocks}, "
                             f"{cp_degree}")
        self.num_blocks, self.cp_degree = int(num_blocks), int(cp_degree)
        self._journal = journal
        self._free = [set(range(num_blocks)) for _ in range(cp_degree)]
        self._free_heap = [list(range(num_blocks)) for _ in range(cp_degree)]
        self._held: list[set[int]] = [set() for _ in range(cp_degree)]  # caller-owned
        self._owned: list[dict[int, int]] = [{} for _ in range(cp_degree)]  # id -> block hash

    # ---- queries ------------------------------------------------------------------------------
    def num_free(self, rank: int) -> int:
        """Free blocks on `rank`."""
        return len(self._free[rank])

    def is_free(self, rank: int, block_id: int) -> bool:
        """Whether block `block_id` of `rank` is free (neither held by a caller nor cached)."""
        return block_id in self._free[rank]

    def free_lists(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the sorted free block ids."""
        return tuple(tuple(sorted(f)) for f in self._free)

    def short_ranks(self, need: Mapping[int, int]) -> set[int]:
        """Ranks r with fewer free blocks than `need[r]`."""
        return {r for r in need if len(self._free[r]) < need[r]}

    def check_fits(self, need: Mapping[int, int], evictable: collections.Counter) -> None:
        """Checks that every rank r can supply `need[r]` blocks from its free blocks plus
        `evictable[r]` blocks that eviction could free (a Counter: missing ranks count 0).

        Raises OutOfBlocksError naming each rank that cannot (needed, free, evictable).
        """
        lacking = sorted(r for r, n in need.items() if n > len(self._free[r]) + evictable[r])
        if lacking:
            detail = ", ".join(f"rank {r}: needs {need[r]}, free {len(self._free[r])}, "
                               f"evictable {evictable[r]}" for r in lacking)
            raise OutOfBlocksError(f"out of KV blocks ({self.num_blocks} per rank): {detail}")

    def check_held(self, rank: int, block_id: int) -> None:
        """Checks that the caller holds block `block_id` of `rank`.

        Raises ValueError for a block id outside `[0, num_blocks)`, a free block, or a block
        owned by the tree (naming its block hash: only eviction frees it).
        """
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be in [0, {self.num_blocks}), got {block_id}")
        if block_id in self._free[rank]:
            raise ValueError(f"block {block_id} on rank {rank} is already free")
        if block_id in self._owned[rank]:
            raise ValueError(f"block {block_id} on rank {rank} is cached (block hash "
                             f"{self._owned[rank][block_id]:#x}); only eviction frees it")

    def check_held_once(self, blocks: Sequence[tuple[int, int]], listed: Sequence[int]) -> None:
        """Checks that each `(rank, block_id)` of `blocks` appears once and is held by the caller.

        Raises ValueError naming `listed` (the caller's block ids) for a block listed twice,
        else as `check_held`.
        """
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block_ids lists a block twice: {list(listed)}")
        for rank, b in blocks:
            self.check_held(rank, b)

    # ---- state changes (each logged to the journal) ------------------------------------------
    def take(self, rank: int, block_id: int | None = None) -> int:
        """Free -> held: block `block_id` of `rank`, or the lowest free one when None.

        Returns the block id. Raises ValueError when the named block is not free (nothing
        changed). With `block_id=None` the rank must have a free block (callers check).
        """
        free = self._free[rank]
        if block_id is not None:
            if block_id not in free:
                raise ValueError(f"block {block_id} on rank {rank} is not free")
        else:
            heap = self._free_heap[rank]
            while True:
                block_id = heapq.heappop(heap)
                if block_id in free:
                    break
        free.discard(block_id)
        self._held[rank].add(block_id)
        self._journal.log(lambda: (self._held[rank].discard(block_id), free.add(block_id)))
        return block_id

    def give(self, rank: int, block_id: int) -> None:
        """Held -> free. Raises ValueError (`check_held`) when the caller does not hold it."""
        self.check_held(rank, block_id)
        self._held[rank].discard(block_id)
        self._free[rank].add(block_id)
        heapq.heappush(self._free_heap[rank], block_id)
        self._journal.log(lambda: (self._free[rank].discard(block_id),
                                   self._held[rank].add(block_id)))

    def adopt(self, rank: int, block_id: int, block_hash: int) -> None:
        """Held -> owned by the tree, as the block of `block_hash`.

        Raises ValueError (nothing changed) when the caller does not hold the block.
        """
        if block_id not in self._held[rank]:
            raise ValueError(f"block {block_id} on rank {rank} is not held by the caller")
        self._held[rank].discard(block_id)
        self._owned[rank][block_id] = block_hash
        self._journal.log(lambda: (self._owned[rank].pop(block_id),
                                   self._held[rank].add(block_id)))

    def release(self, rank: int, block_id: int) -> None:
        """Owned by the tree -> free (the block's node was evicted). KeyError when not owned."""
        block_hash = self._owned[rank].pop(block_id)
        self._free[rank].add(block_id)
        heapq.heappush(self._free_heap[rank], block_id)
        self._journal.log(lambda: (self._free[rank].discard(block_id),
                                   self._owned[rank].__setitem__(block_id, block_hash)))

    def rebuild_heaps(self) -> None:
        """Rebuilds the lazy free-id heaps from the free sets (after a rollback)."""
        self._free_heap = [sorted(f) for f in self._free]
