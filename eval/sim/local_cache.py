"""A worker's local prefix cache in the simulator: LRU over chain-hashed blocks.

Semantics follow vLLM's prefix caching (v1 `BlockPool` / `FreeKVCacheBlockQueue`): only full
blocks are cached, a hit is the longest leading run of the request's block hashes, and when a
request's blocks are touched they are touched from the last to the first, so that a prefix's
ancestors are always more recent than its descendants and LRU eviction takes leaves first
(SGLang's radix cache evicts LRU leaves for the same reason). Capacity is in blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from serving.policy.worker import is_aligned_tiling

try:  # the C loop behind `collections.Counter.update`: counts an iterable into a dict
    from collections import _count_elements as count_elements
except ImportError:  # pragma: no cover (Python builds without the C helper)
    def count_elements(mapping: dict, iterable) -> None:
        """`mapping[x] += 1` for each x of `iterable` (missing keys start at 0)."""
        get = mapping.get
        for x in iterable:
            mapping[x] = get(x, 0) + 1

_ABSENT = object()


class LocalPrefixCache:
    """LRU block cache of one worker.

    Args:
      capacity_blocks: blocks the worker's KV pool holds (all ranks together), >= 1.

    Raises:
      ValueError: capacity_blocks < 1.
    """

    __slots__ = ("capacity_blocks", "_lru", "_reserved", "_children")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        # hash -> parent hash, least recently used first: a plain dict keeps insertion order, so
        # touching a block is `pop` + re-insert (cheaper under churn than an OrderedDict, whose
        # node index is rebuilt each time the underlying table is).
        self._lru: dict[int, int | None] = {}
        self._reserved = 0  # blocks allocated to a running prefill, not yet cached
        # hash -> number of cached blocks whose parent it is; built on the first
        # `reclaim_suffix` and kept up to date from then on (None: not tracked, no cost).
        self._children: dict[int, int] | None = None

    def _insert(self, h: int, parent: int | None) -> None:
        self._lru[h] = parent
        children = self._children
        if children is not None and parent is not None:
            children[parent] = children.get(parent, 0) + 1

    def _forget(self, parent: int | None) -> None:
        children = self._children
        if children is not None and parent is not None:
            n = children[parent] - 1
            if n:
                children[parent] = n
            else:
                del children[parent]

    def _evict_lru(self, n: int) -> list[int]:
        lru = self._lru
        evicted = list(islice(lru, n))  # the n least recently used, oldest first
        children = self._children
        if children is None:
            for h in evicted:
                del lru[h]
            return evicted
        for parent in [lru.pop(h) for h in evicted]:  # inline of `_forget`
            if parent is not None:
                c = children[parent] - 1
                if c:
                    children[parent] = c
                else:
                    del children[parent]
        return evicted

    def __len__(self) -> int:
        return len(self._lru)

    def block_view(self):
        """The cached block hashes as a live read-only set view (`dict.keys()`): it follows every
        later insertion and eviction (for `PrefixIndex.share_blocks`)."""
        return self._lru.keys()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    @property
    def free_blocks(self) -> int:
        """Blocks neither cached nor reserved by a running prefill."""
        return self.capacity_blocks - len(self._lru) - self._reserved

    def match(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """Longest leading run of `block_hashes` (at most `max_blocks`) held here; no side effect."""
        lru = self._lru
        k = 0
        limit = min(max_blocks, len(block_hashes))
        while k < limit and block_hashes[k] in lru:
            k += 1
        return k

    def begin(self, block_hashes: Sequence[int], max_blocks: int, total_blocks: int) -> tuple[int, list[int]]:
        """Starts a prefill: takes the hit, reserves room for the rest, evicts LRU blocks.

        Args:
          block_hashes: the request's hash chain.
          max_blocks: cap on the hit (`Request.max_cacheable_blocks`).
          total_blocks: blocks the prefill needs in all (`ceil(input_len / block_size)`).

        Returns:
          `(hit_blocks, evicted)`: the matched leading blocks (touched, most recent first) and
          the hashes evicted to make room for `total_blocks - hit_blocks` new blocks.

        Raises:
          ValueError: `total_blocks` exceeds the capacity (nothing changed).
        """
        if total_blocks > self.capacity_blocks:
            raise ValueError(
                f"request needs {total_blocks} KV blocks, more than the worker's "
                f"capacity_blocks={self.capacity_blocks}")
        lru = self._lru
        hit = 0  # inline of `match` (hot path)
        limit = min(max_blocks, len(block_hashes))
        while hit < limit and block_hashes[hit] in lru:
            hit += 1
        for k in range(hit - 1, -1, -1):  # touch the hit, last block first
            h = block_hashes[k]
            lru[h] = lru.pop(h)
        need = total_blocks - hit
        over = len(lru) + self._reserved + need - self.capacity_blocks
        evicted = self._evict_lru(over) if over > 0 else []
        self._reserved += need
        return hit, evicted

    def finish(self, block_hashes: Sequence[int], hit_blocks: int, full_blocks: int,
               total_blocks: int) -> list[int]:
        """Ends a prefill: caches its new full blocks, releases its reservation.

        Args:
          block_hashes: the request's hash chain.
          hit_blocks: the hit `begin` returned.
          full_blocks: full blocks of the prompt (`input_len // block_size`).
          total_blocks: the `total_blocks` given to `begin`.

        Returns:
          The hashes newly inserted (blocks `hit_blocks .. full_blocks-1` not already cached).
        """
        self._reserved -= total_blocks - hit_blocks
        lru = self._lru
        new = block_hashes[hit_blocks:full_blocks]
        children = self._children
        n = len(lru)
        fast = bool(new) and lru.keys().isdisjoint(new)
        if fast:
            # Hot path, none of the new blocks cached yet: insert them at C speed, last first.
            parents = block_hashes[hit_blocks - 1:full_blocks - 1] if hit_blocks else (
                (None, *block_hashes[:full_blocks - 1]))
            inserted = new[::-1]
            lru.update(zip(inserted, parents[::-1]))
            if len(lru) - n == len(new):
                if children is not None:  # parents of blocks 1.. (block 0 has none)
                    count_elements(children, block_hashes[max(hit_blocks, 1) - 1:full_blocks - 1])
                inserted = list(inserted)
            else:  # a hash repeats within the chain: undo, then one block at a time
                for h in new:
                    lru.pop(h, None)
                fast = False
        if not fast:
            inserted = []
            for k in range(full_blocks - 1, hit_blocks - 1, -1):
                h = block_hashes[k]
                if h in lru:
                    lru[h] = lru.pop(h)  # touch
                    continue
                self._insert(h, block_hashes[k - 1] if k else None)
                inserted.append(h)
        # Re-touch the hit so that ancestors stay more recent than the new descendants.
        for k in range(hit_blocks - 1, -1, -1):
            h = block_hashes[k]
            if h in lru:
                lru[h] = lru.pop(h)
        return inserted

    def evict_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """Drops the given blocks if present; returns those that were present."""
        lru, out = self._lru, []
        for h in block_hashes:
            parent = lru.pop(h, _ABSENT)
            if parent is not _ABSENT:
                self._forget(parent)
                out.append(h)
        return out

    def insert_chain(self, chain: Sequence[int]) -> tuple[list[int], list[int]]:
        """Adds the blocks of a copied prefix `chain` (root first) that are missing.

        The whole chain becomes most recent, ancestors more recent than descendants; LRU blocks
        are evicted when the cache overflows. A chain longer than the capacity is not copied.

        Returns:
          `(inserted, evicted)` hashes.
        """
        if len(chain) > self.capacity_blocks - self._reserved:
            return [], []
        lru = self._lru
        inserted = []
        for k in range(len(chain) - 1, -1, -1):
            h = chain[k]
            if h in lru:
                lru[h] = lru.pop(h)  # touch
            else:
                self._insert(h, chain[k - 1] if k else None)
                inserted.append(h)
        over = len(lru) + self._reserved - self.capacity_blocks
        return inserted, self._evict_lru(over) if over > 0 else []

    def reclaim_suffix(self, chain: Sequence[int]) -> list[int]:
        """Drops the cached tail of `chain` that no other cached prefix depends on.

        Walks from the chain's last block toward the root, evicting each cached block that is
        a leaf (no cached child), so other prefixes sharing an ancestor keep it. O(len(chain)).

        Returns:
          The evicted hashes, deepest first.
        """
        lru = self._lru
        if self._children is None:  # start tracking: one O(n) pass, then incremental
            self._children = {}
            count_elements(self._children, (p for p in lru.values() if p is not None))
        children = self._children
        evicted = []
        for h in reversed(chain):
            if h not in lru or h in children:
                break
            self._forget(lru.pop(h))
            evicted.append(h)
        return evicted

    def restore_ancestor_order(self) -> None:
        """Reorders the LRU so every cached parent is more recent than its cached children
        (`ancestor_order`). O(n log n)."""
        lru = self._lru
        order = ancestor_order(list(lru.items()))
        lru.clear()
        lru.update(order)

    def blocks(self) -> list[tuple[int, int | None]]:
        """`(hash, parent hash)` of every cached block, least recently used first."""
        return list(self._lru.items())

    def adopt(self, blocks: Sequence[tuple[int, int | None]]) -> list[int]:
        """Adds blocks (least recently used first, as `blocks()` gives them) as the most recent.

        Blocks already present are skipped. When the cache overflows, its LRU blocks are evicted.

        Returns:
          The evicted hashes.
        """
        lru = self._lru
        for h, parent in blocks:
            if h not in lru:
                self._insert(h, parent)
        over = len(lru) + self._reserved - self.capacity_blocks
        return self._evict_lru(over) if over > 0 else []


def ancestor_order(items: Sequence[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
    """`(hash, parent hash)` items (least recently used first) reordered so that every parent
    in `items` is more recent than its children; otherwise as little as possible changes.

    Merging two caches interleaves their recency orders and can leave a shared parent older
    than a child, so LRU eviction would take a parent before its leaves. A block's recency
    becomes the most recent of its own and its descendants' in `items`. O(n log n).

    Raises:
      ValueError: the parent links form a cycle.
    """
    parent_of = dict(items)
    rank = {h: float(i) for i, (h, _) in enumerate(items)}
    depth: dict[int, int] = {}
    for h in parent_of:  # depth within the items (walk up parents present)
        path, x = [], h
        while x is not None and x in parent_of and x not in depth:
            path.append(x)
            x = parent_of[x]
            if len(path) > len(parent_of):
                raise ValueError(f"the parent links of the cached blocks form a cycle (through "
                                 f"block {x}); they must form a forest (hash chains)")
        d = depth.get(x, -1) if x is not None and x in parent_of else -1
        for y in reversed(path):
            d += 1
            depth[y] = d
    for h in sorted(parent_of, key=depth.__getitem__, reverse=True):  # deepest first
        p = parent_of[h]
        if p is not None and p in rank and rank[p] <= rank[h]:
            rank[p] = rank[h] + 0.5
    return sorted(parent_of.items(), key=lambda item: rank[item[0]])


def split_cache(cache: LocalPrefixCache, capacity_blocks: int) -> tuple[LocalPrefixCache, LocalPrefixCache]:
    """The caches of the two halves of a split worker (paper section 6, cache coordination).

    Each retained prefix is assigned to one half and the other half drops it: walking blocks from
    the most to the least recent (ancestors are always more recent than their descendants), a
    block whose parent is cached follows its parent; a root goes to the half holding fewer
    blocks so far (balancing free capacity, the hottest roots first). Each half keeps the
    recency order and holds at most `capacity_blocks`.

    Raises:
      ValueError: the cache has a prefill in progress (split a drained worker only).
    """
    if cache._reserved:
        raise ValueError("cannot split a cache while a prefill holds reserved blocks")
    halves = (LocalPrefixCache(capacity_blocks), LocalPrefixCache(capacity_blocks))
    side: dict[int, int] = {}
    picked: tuple[list, list] = ([], [])
    for h, parent in reversed(cache.blocks()):
        k = side.get(parent) if parent is not None else None
        if k is None:
            k = 0 if len(picked[0]) <= len(picked[1]) else 1
        side[h] = k
        picked[k].append((h, parent))
    for half, items in zip(halves, picked):
        half.adopt(items[::-1])  # back to least recent first
    return halves


def split_cache_parts(cache: LocalPrefixCache, parts: Sequence[int], blocks_per_device: int
                      ) -> list[LocalPrefixCache]:
    """The caches of the parts of a worker split in one re-carve into CP degrees `parts`
    (device order; `serving.policy.worker.is_aligned_tiling`): `split_cache` applied as the
    halving that makes those parts would apply it, each part holding at most
    `blocks_per_device * its degree` blocks.

    Raises:
      ValueError: `parts` is not an aligned tiling (of at least one part), or the cache has a
        prefill in progress.
    """
    parts = list(parts)
    total = sum(parts)
    if not parts or not is_aligned_tiling(total, parts):
        raise ValueError(f"parts must be CP degrees that halving makes, got {parts}")
    if len(parts) == 1:
        return [cache]
    at, k = 0, 0
    while at < total // 2:  # (the lower half's parts: a tiling ends exactly at its middle)
        at, k = at + parts[k], k + 1
    lower, upper = split_cache(cache, blocks_per_device * (total // 2))
    return (split_cache_parts(lower, parts[:k], blocks_per_device)
            + split_cache_parts(upper, parts[k:], blocks_per_device))
