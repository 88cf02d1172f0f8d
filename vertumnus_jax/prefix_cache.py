"""A worker's local prefix cache: a radix tree over block hashes with a striped block allocator.

Keys are *chained* block hashes (`block_hashes`): block k's hash covers every token up to the
end of block k, so walking the tree from the root matches only a contiguous leading run of a
prompt's blocks; a request sharing only a later block gets no hit. Each tree node owns one
physical KV block. Under block striping a node at depth i (block i of its sequences) lives on
rank `i mod C`, so the allocator (`vertumnus_jax.block_allocator`) keeps one free list per rank.

Reference counts (SGLang's lock refs): `lock` increments every node on a path, `unlock`
decrements; a node with refcount 0 and no children is an evictable leaf. Eviction is LRU over
those leaves (logical access ticks, no clock), and a parent whose last child goes becomes a leaf.
Every insertion and eviction is appended to an event stream (vLLM's KV events: BlockStored /
BlockRemoved) that the scheduler's global trie consumes; `PrefixCache.replay` rebuilds the same
tree and free lists from it.

Only full blocks are cached; a request's last partial block is allocated, written and freed by
its owner (`allocate` / `free`) without entering the tree. Each block id of a rank is free, held
by a caller, or owned by the tree, so a double free or a free of a cached block is rejected.
Refcounts keep `parent.ref >= sum(child.ref)` (an unlock that would break it is rejected), and
`transaction()` undoes every change of a failed multi-step operation (a request's match, lock,
allocate with evictions, insert), events and LRU ages included (`vertumnus_jax.undo_journal`).
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterable, Iterator, Sequence

from vertumnus_jax.block_allocator import BlockAllocator, rank_demand
from vertumnus_jax.block_hash import block_content_id, block_hashes, chain_hashes
from vertumnus_jax.cache_event import CachedBlock, CacheEvent, OutOfBlocksError
from vertumnus_jax.radix_node import RadixNode, cached_path, evictable_per_rank, uncovers, walk
from vertumnus_jax.undo_journal import UndoJournal

__all__ = ["CacheEvent", "CachedBlock", "OutOfBlocksError", "PrefixCache", "block_content_id",
           "block_hashes", "chain_hashes"]


class PrefixCache:
    """Radix tree over chained block hashes, with per-rank free lists and LRU eviction.

    Every block id of a rank is in exactly one of three states: free, held by a caller (returned
    by `allocate`, not yet `insert`ed or `free`d), or owned by the tree (a cached node).
    Mutations that fail raise with the cache unchanged (state, refcounts, LRU ages, events).

    Args:
      num_blocks: KV blocks per device (per rank), >= 1.
      cp_degree: the worker's CP degree C (ranks), a power of two >= 1. Block at sequence
        index i lives on rank `i % C`.

    Raises:
      ValueError: for `num_blocks < 1` or a CP degree that is not a power of two >= 1.

    Source: SGLang RadixCache (page-aligned keys, lock refs, LRU of leaves); vLLM v1 KV events.
    """

    def __init__(self, num_blocks: int, cp_degree: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if cp_degree < 1 or cp_degree & (cp_degree - 1):
            raise ValueError(f"cp_degree must be a power of two >= 1, got {cp_degree}")
        self.num_blocks, self.cp_degree = int(num_blocks), int(cp_degree)
        self._root = RadixNode(block_hash=0, parent=None, depth=-1, rank=-1, block_id=-1)
        self._nodes: dict[int, RadixNode] = {}
        self._journal = UndoJournal()  # undo log of an open transaction
        self._blocks = BlockAllocator(num_blocks, cp_degree, self._journal)
        self._lru: list[tuple[int, int, int]] = []  # (last_access, seq, block_hash), lazy
        self._tick = 0
        self._seq = 0
        self.events: list[CacheEvent] = []

    # ---- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._nodes

    def num_free(self, rank: int) -> int:
        """Free blocks on `rank`."""
        return self._blocks.num_free(rank)

    def is_free(self, rank: int, block_id: int) -> bool:
        """Whether block `block_id` of `rank` is free (neither held by a caller nor cached)."""
        return self._blocks.is_free(rank, block_id)

    def refcount(self, block_hash: int) -> int:
        """Reference count of a cached block (KeyError when not cached)."""
        return self._nodes[block_hash].ref

    def block_id(self, block_hash: int) -> int:
        """Physical block id of a cached block (KeyError when not cached)."""
        return self._nodes[block_hash].block_id

    def blocks(self) -> list[CachedBlock]:
        """Every cached block, parents before children, with its refcount and LRU tick."""
        return [CachedBlock(h, n.parent.block_hash if n.parent.depth >= 0 else None, n.depth,
                            n.rank, n.block_id, n.ref, n.last_access)
                for h, n in self._nodes.items()]

    def state(self) -> dict:
        """Canonical contents: {"nodes": {hash: (parent_hash, rank, block_id)}, "free": per-rank
        sorted free ids}. Equal states mean equal trees and allocations."""
        nodes = {b.block_hash: (b.parent_hash, b.rank, b.block_id) for b in self.blocks()}
        return {"nodes": nodes, "free": self._blocks.free_lists()}

    def match(self, hashes: Sequence[int], *, touch: bool = True) -> list[int]:
        """Block ids of the longest cached leading run of `hashes` (block i on rank i % C).

        With `touch`, marks the matched blocks as accessed now (LRU). Does not lock them.
        """
        path = walk(self._root, hashes)
        if touch:
            self._tick += 1
            for node in path:
                self._touch(node)
        return [n.block_id for n in path]

    def validate_chain(self, hashes: Sequence[int]) -> None:
        """Checks that `hashes` can be a path from the root: no hash repeats, and every hash past
        the cached leading run is not cached elsewhere in the tree.

        Raises ValueError naming the offending hash and its index.
        """
        seen: set[int] = set()
        for i, h in enumerate(int(x) for x in hashes):
            if h in seen:
                raise ValueError(f"block hash {h:#x} repeats at index {i} of the chain")
            seen.add(h)
        path = walk(self._root, hashes)
        for i in range(len(path), len(hashes)):
            h = int(hashes[i])
            if h in self._nodes:
                raise ValueError(f"block hash {h:#x} at index {i} is already cached under "
                                 "another parent (not a hash chain from the root)")

    # ---- transactions -------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """All-or-nothing block: when the body raises, every change made inside it (tree,
        refcounts, LRU ages, free lists, held blocks, events) is undone before re-raising.
        Nested transactions join the outermost one."""
        n_events, tick = len(self.events), self._tick

        def restore() -> None:  # after the undo operations: what the journal does not log
            del self.events[n_events:]
            self._tick = tick
            self._blocks.rebuild_heaps()
            self._lru = []
            for node in self._nodes.values():
                self._push_if_evictable(node)

        with self._journal.transaction(restore):
            yield

    # ---- reference counts ---------------------------------------------------------------------
    def lock(self, hashes: Sequence[int]) -> None:
        """Pins every block of the cached path `hashes` (refcount + 1) against eviction.

        Raises KeyError when `hashes` is not entirely a cached path from the root.
        """
        path = cached_path(self._root, hashes)
        for node in path:
            node.ref += 1
        self._journal.log(lambda: self._add_refs(path, -1))

    def unlock(self, hashes: Sequence[int]) -> None:
        """Undoes one `lock(hashes)`.

        Raises KeyError on an uncached path, ValueError (nothing changed) on a block whose
        refcount is 0, or when the path's last block would keep fewer references than its
        children hold together (`hashes` is not a path that was locked, e.g. a prefix of one).
        """
        path = cached_path(self._root, hashes)
        if any(n.ref < 1 for n in path):
            raise ValueError("unlock of a block whose refcount is 0")
        if path:
            last = path[-1]
            below = sum(c.ref for c in last.children.values())
            if last.ref - 1 < below:
                raise ValueError(
                    f"unlock of block hash {last.block_hash:#x} would leave refcount "
                    f"{last.ref - 1} below its children's {below}: unlock exactly a locked path")
        self._add_refs(path, -1)
        self._journal.log(lambda: self._add_refs(path, +1))

    def _add_refs(self, path: list[RadixNode], delta: int) -> None:
        for node in path:
            node.ref += delta
            self._push_if_evictable(node)

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, first_index: int, count: int) -> list[int]:
        """Free blocks for sequence indices `first_index .. first_index + count - 1`.

        Block i comes from rank `i % C`. When a rank is short, unreferenced leaves are evicted
        in LRU order among those on a short rank (then, if none, among leaves whose eviction
        uncovers an unreferenced block of a short rank) until every rank has enough. The
        caller owns the returned blocks until it `insert`s or `free`s them.

        Raises:
          ValueError: for a negative `first_index` or `count`.
          OutOfBlocksError: when a rank lacks blocks even after evicting every unreferenced
            block; nothing is evicted or allocated then.
        """
        c = self.cp_degree
        need = rank_demand(first_index, count, c)
        if self._blocks.short_ranks(need):
            self._blocks.check_fits(need, evictable_per_rank(self._root))
        with self.transaction():
            while ranks := self._blocks.short_ranks(need):
                self._evict_one(ranks)
            return [self._blocks.take((first_index + k) % c) for k in range(count)]

    def free(self, first_index: int, block_ids: Sequence[int]) -> None:
        """Returns blocks the caller holds (from `allocate`, not inserted): block k at sequence
        index `first_index + k`, on rank `(first_index + k) % C`.

        Raises ValueError, with nothing freed, for a block out of range, already free, owned by
        the tree (cached: only eviction frees it), or listed twice.
        """
        if first_index < 0:
            raise ValueError(f"first_index must be >= 0, got {first_index}")
        blocks = [((first_index + k) % self.cp_degree, int(b)) for k, b in enumerate(block_ids)]
        self._blocks.check_held_once(blocks, block_ids)
        with self.transaction():
            for rank, b in blocks:
                self._blocks.give(rank, b)

    # ---- insertion and eviction ---------------------------------------------------------------
    def insert(self, hashes: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        """Caches the path `hashes` (from the root) whose blocks are `block_ids`.

        Blocks already cached keep their block; a given block that duplicates a cached one is
        freed (the caller must hold it). New blocks pass from the caller to the cache.

        Returns:
          The cached block id of every hash (the existing ones where already cached).

        Raises:
          ValueError, with nothing changed: when the lengths differ, the hashes are not a chain
            (`validate_chain`), or a block that is not already the cached one is not held by
            the caller (free, cached elsewhere, or listed twice).
        """
        if len(hashes) != len(block_ids):
            raise ValueError(f"hashes ({len(hashes)}) and block_ids ({len(block_ids)}) differ "
                             "in length")
        hashes, block_ids = [int(h) for h in hashes], [int(b) for b in block_ids]
        self.validate_chain(hashes)
        path = walk(self._root, hashes)
        given = [(i % self.cp_degree, b) for i, b in enumerate(block_ids)
                 if i >= len(path) or path[i].block_id != b]
        self._blocks.check_held_once(given, block_ids)
        with self.transaction():
            self._tick += 1
            node, out = self._root, []
            for i, (h, b) in enumerate(zip(hashes, block_ids, strict=True)):
                child = node.children.get(h)
                if child is None:
                    child = self._add(node, h, i % self.cp_degree, b)
                elif child.block_id != b:
                    self._blocks.give(child.rank, b)
                self._touch(child)
                out.append(child.block_id)
                node = child
            return out

    def _add(self, parent: RadixNode, h: int, rank: int, block_id: int) -> RadixNode:
        if h in self._nodes:
            raise ValueError(f"block hash {h:#x} is already cached under another parent")
        self._blocks.adopt(rank, block_id, h)  # held -> owned by the tree
        node = RadixNode(block_hash=h, parent=parent, depth=parent.depth + 1, rank=rank,
                         block_id=block_id)
        self._link(node)
        self._journal.log(lambda: self._unlink(node))
        self.events.append(CacheEvent(
            "insert", h, parent.block_hash if parent is not self._root else None, rank, block_id))
        return node

    def _link(self, node: RadixNode) -> None:
        node.parent.children[node.block_hash] = node
        self._nodes[node.block_hash] = node

    def _unlink(self, node: RadixNode) -> None:
        del node.parent.children[node.block_hash]
        del self._nodes[node.block_hash]

    def _touch(self, node: RadixNode) -> None:
        old = node.last_access
        node.last_access = self._tick
        self._journal.log(lambda: setattr(node, "last_access", old))
        self._push_if_evictable(node)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if node.ref == 0 and not node.children and node is not self._root:
            self._seq += 1
            heapq.heappush(self._lru, (node.last_access, self._seq, node.block_hash))

    def _evict_one(self, ranks: set[int] | None = None) -> None:
        """Evicts the LRU unreferenced leaf (on `ranks` when given; else, failing that, the LRU
        leaf that uncovers a block of `ranks`). Raises OutOfBlocksError when there is none."""
        skipped, fallback = [], None
        try:
            while self._lru:
                entry = heapq.heappop(self._lru)
                access, _, h = entry
                node = self._nodes.get(h)
                if node is None or node.ref or node.children or node.last_access != access:
                    continue  # stale entry
                skipped.append(entry)
                if ranks is None or node.rank in ranks:
                    self._remove(node)
                    return
                if fallback is None and uncovers(self._root, node, ranks):
                    fallback = node
        finally:
            for entry in skipped:
                heapq.heappush(self._lru, entry)
        if fallback is None:
            raise OutOfBlocksError(f"no evictable block for ranks {sorted(ranks or ())}")
        self._remove(fallback)

    def _remove(self, node: RadixNode) -> None:
        parent = node.parent
        self._unlink(node)
        self._blocks.release(node.rank, node.block_id)  # owned by the tree -> free
        self._journal.log(lambda: self._link(node))
        self.events.append(CacheEvent(
            "evict", node.block_hash, parent.block_hash if parent is not self._root else None,
            node.rank, node.block_id))
        self._push_if_evictable(parent)

    def evict(self, num_blocks: int) -> int:
        """Evicts up to `num_blocks` unreferenced leaves in LRU order; returns how many went."""
        done = 0
        while done < num_blocks and any(n.ref == 0 and not n.children
                                        for n in self._nodes.values()):
            self._evict_one()
            done += 1
        return done

    def evict_tail(self, hashes: Sequence[int]) -> list[int]:
        """Evicts the cached path `hashes` from its deepest cached block up while the block is an
        unreferenced leaf (its unshared tail); returns those hashes, deepest first (+ events)."""
        path, out = walk(self._root, hashes), []
        with self.transaction():
            while path and path[-1].ref == 0 and not path[-1].children:
                node = path.pop()
                self._remove(node)
                out.append(node.block_hash)
        return out

    def drain_events(self) -> list[CacheEvent]:
        """Returns and clears the events since the last drain."""
        out, self.events = self.events, []
        return out

    @classmethod
    def replay(cls, num_blocks: int, cp_degree: int, events: Iterable[CacheEvent]
               ) -> PrefixCache:
        """A fresh cache with `events` applied in order (same tree and free lists).

        Raises ValueError on an event inconsistent with the state: an insert under an unknown
        parent, of a hash already cached, on a rank other than `depth % C`, or of a block that
        is not free; an evict of an unknown block, of a non-leaf, or whose parent, rank or
        block id differ from the cached node's; an unknown kind.
        """
        cache = cls(num_blocks, cp_degree)
        for ev in events:
            if ev.kind == "insert":
                parent = cache._root if ev.parent_hash is None else cache._nodes.get(ev.parent_hash)
                if parent is None:
                    raise ValueError(f"insert of {ev.block_hash:#x} under unknown parent")
                rank = (parent.depth + 1) % cache.cp_degree
                if ev.rank != rank:
                    raise ValueError(f"insert of {ev.block_hash:#x} at depth {parent.depth + 1} "
                                     f"must be on rank {rank}, got {ev.rank}")
                if ev.block_hash in cache._nodes:
                    raise ValueError(f"insert of {ev.block_hash:#x}: already cached")
                if not 0 <= ev.block_id < num_blocks:
                    raise ValueError(f"insert of {ev.block_hash:#x}: block id must be in "
                                     f"[0, {num_blocks}), got {ev.block_id}")
                cache._blocks.take(rank, ev.block_id)
                cache._tick += 1
                cache._touch(cache._add(parent, ev.block_hash, rank, ev.block_id))
            elif ev.kind == "evict":
                node = cache._nodes.get(ev.block_hash)
                if node is None or node.children:
                    raise ValueError(f"evict of {ev.block_hash:#x}: unknown block or not a leaf")
                parent = node.parent.block_hash if node.parent is not cache._root else None
                if (ev.parent_hash, ev.rank, ev.block_id) != (parent, node.rank, node.block_id):
                    raise ValueError(
                        f"evict of {ev.block_hash:#x}: (parent, rank, block) "
                        f"{(ev.parent_hash, ev.rank, ev.block_id)} differ from the cached "
                        f"{(parent, node.rank, node.block_id)}")
                cache._remove(node)
            else:
                raise ValueError(f"event kind must be 'insert' or 'evict', got {ev.kind!r}")
        return cache
