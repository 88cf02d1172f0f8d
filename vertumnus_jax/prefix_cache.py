"""A worker's local prefix cache: a radix tree over block hashes with a striped block allocator.

Keys are *chained* block hashes (`block_hashes`): block k's hash covers every token up to the
end of block k, so walking the tree from the root matches only a contiguous leading run of a
prompt's blocks; a request sharing only a later block gets no hit. Each tree node owns one
physical KV block. Under block striping a node at depth i (block i of its sequences) lives on
rank `i mod C`, so the allocator keeps one free list per rank.

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
allocate with evictions, insert), events and LRU ages included.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence

from vertumnus_jax.block_hash import block_content_id, block_hashes, chain_hashes  # noqa: F401
from vertumnus_jax.cache_event import CachedBlock, CacheEvent, OutOfBlocksError


@dataclasses.dataclass(eq=False)
class _Node:
    block_hash: int
    parent: _Node | None
    depth: int
    rank: int
    block_id: int
    children: dict[int, _Node] = dataclasses.field(default_factory=dict)
    ref: int = 0
    last_access: int = 0


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
        self._root = _Node(block_hash=0, parent=None, depth=-1, rank=-1, block_id=-1)
        self._nodes: dict[int, _Node] = {}
        self._free = [set(range(num_blocks)) for _ in range(cp_degree)]
        self._free_heap = [list(range(num_blocks)) for _ in range(cp_degree)]
        self._held: list[set[int]] = [set() for _ in range(cp_degree)]  # caller-owned
        self._owner: list[dict[int, _Node]] = [{} for _ in range(cp_degree)]  # tree-owned
        self._lru: list[tuple[int, int, int]] = []  # (last_access, seq, block_hash), lazy
        self._tick = 0
        self._seq = 0
        self._undo: list[Callable[[], None]] | None = None  # journal of an open transaction
        self.events: list[CacheEvent] = []

    # ---- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._nodes

    def num_free(self, rank: int) -> int:
        """Free blocks on `rank`."""
        return len(self._free[rank])

    def is_free(self, rank: int, block_id: int) -> bool:
        """Whether block `block_id` of `rank` is free (neither held by a caller nor cached)."""
        return block_id in self._free[rank]

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
        return {"nodes": nodes, "free": tuple(tuple(sorted(f)) for f in self._free)}

    def _walk(self, hashes: Sequence[int]) -> list[_Node]:
        path, node = [], self._root
        for h in hashes:
            node = node.children.get(int(h))
            if node is None:
                break
            path.append(node)
        return path

    def match(self, hashes: Sequence[int], *, touch: bool = True) -> list[int]:
        """Block ids of the longest cached leading run of `hashes` (block i on rank i % C).

        With `touch`, marks the matched blocks as accessed now (LRU). Does not lock them.
        """
        path = self._walk(hashes)
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
        path = self._walk(hashes)
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
        if self._undo is not None:
            yield
            return
        self._undo, n_events, tick = [], len(self.events), self._tick
        try:
            yield
        except BaseException:
            undo, self._undo = self._undo, None
            for op in reversed(undo):
                op()
            del self.events[n_events:]
            self._tick = tick
            self._rebuild_heaps()
            raise
        finally:
            self._undo = None

    def _log(self, op: Callable[[], None]) -> None:
        if self._undo is not None:
            self._undo.append(op)

    def _rebuild_heaps(self) -> None:
        self._free_heap = [sorted(f) for f in self._free]
        self._lru = []
        for node in self._nodes.values():
            self._push_if_evictable(node)

    # ---- reference counts ---------------------------------------------------------------------
    def lock(self, hashes: Sequence[int]) -> None:
        """Pins every block of the cached path `hashes` (refcount + 1) against eviction.

        Raises KeyError when `hashes` is not entirely a cached path from the root.
        """
        path = self._path_or_raise(hashes)
        for node in path:
            node.ref += 1
        self._log(lambda: self._add_refs(path, -1))

    def unlock(self, hashes: Sequence[int]) -> None:
        """Undoes one `lock(hashes)`.

        Raises KeyError on an uncached path, ValueError (nothing changed) on a block whose
        refcount is 0, or when the path's last block would keep fewer references than its
        children hold together (`hashes` is not a path that was locked, e.g. a prefix of one).
        """
        path = self._path_or_raise(hashes)
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
        self._log(lambda: self._add_refs(path, +1))

    def _add_refs(self, path: list[_Node], delta: int) -> None:
        for node in path:
            node.ref += delta
            self._push_if_evictable(node)

    def _path_or_raise(self, hashes):
        path = self._walk(hashes)
        if len(path) != len(hashes):
            raise KeyError(f"block hash {int(hashes[len(path)]):#x} at depth {len(path)} is "
                           "not cached")
        return path

    # ---- allocation -----------------------------------------------------------------------------
    def _evictable_per_rank(self) -> collections.Counter:
        """Blocks per rank that eviction can free: nodes whose whole subtree is unreferenced."""
        order, stack = [], [self._root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        clear: dict[int, bool] = {}
        counts: collections.Counter = collections.Counter()
        for node in reversed(order):  # children before parents
            ok = node.ref == 0 and all(clear[id(c)] for c in node.children.values())
            clear[id(node)] = ok
            if ok and node is not self._root:
                counts[node.rank] += 1
        return counts

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
        if first_index < 0 or count < 0:
            raise ValueError(f"first_index and count must be >= 0, got {first_index}, {count}")
        c = self.cp_degree
        need = collections.Counter((first_index + k) % c for k in range(count))
        short = {r: need[r] - len(self._free[r]) for r in need if need[r] > len(self._free[r])}
        if short:
            evictable = self._evictable_per_rank()
            lacking = {r: s - evictable[r] for r, s in short.items() if s > evictable[r]}
            if lacking:
                detail = ", ".join(
                    f"rank {r}: needs {need[r]}, free {len(self._free[r])}, evictable "
                    f"{evictable[r]}" for r in sorted(lacking))
                raise OutOfBlocksError(f"out of KV blocks ({self.num_blocks} per rank): {detail}")
        with self.transaction():
            while True:
                ranks = {r for r in need if len(self._free[r]) < need[r]}
                if not ranks:
                    break
                self._evict_one(ranks)
            return [self._take((first_index + k) % c) for k in range(count)]

    def free(self, first_index: int, block_ids: Sequence[int]) -> None:
        """Returns blocks the caller holds (from `allocate`, not inserted): block k at sequence
        index `first_index + k`, on rank `(first_index + k) % C`.

        Raises ValueError, with nothing freed, for a block out of range, already free, owned by
        the tree (cached: only eviction frees it), or listed twice.
        """
        if first_index < 0:
            raise ValueError(f"first_index must be >= 0, got {first_index}")
        blocks = [((first_index + k) % self.cp_degree, int(b)) for k, b in enumerate(block_ids)]
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block_ids lists a block twice: {list(block_ids)}")
        for rank, b in blocks:
            self._check_held(rank, b)
        with self.transaction():
            for rank, b in blocks:
                self._give(rank, b)

    def _check_held(self, rank: int, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be in [0, {self.num_blocks}), got {block_id}")
        if block_id in self._free[rank]:
            raise ValueError(f"block {block_id} on rank {rank} is already free")
        if block_id in self._owner[rank]:
            node = self._owner[rank][block_id]
            raise ValueError(f"block {block_id} on rank {rank} is cached (block hash "
                             f"{node.block_hash:#x}); only eviction frees it")

    def _take(self, rank: int, block_id: int | None = None) -> int:
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
        self._log(lambda: (self._held[rank].discard(block_id), free.add(block_id)))
        return block_id

    def _give(self, rank: int, block_id: int) -> None:
        self._check_held(rank, block_id)
        self._held[rank].discard(block_id)
        self._free[rank].add(block_id)
        heapq.heappush(self._free_heap[rank], block_id)
        self._log(lambda: (self._free[rank].discard(block_id), self._held[rank].add(block_id)))

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
        path = self._walk(hashes)
        given = [(i % self.cp_degree, b) for i, b in enumerate(block_ids)
                 if i >= len(path) or path[i].block_id != b]
        if len(set(given)) != len(given):
            raise ValueError(f"block_ids lists a block twice: {block_ids}")
        for rank, b in given:
            self._check_held(rank, b)
        with self.transaction():
            self._tick += 1
            node, out = self._root, []
            for i, (h, b) in enumerate(zip(hashes, block_ids, strict=True)):
                child = node.children.get(h)
                if child is None:
                    child = self._add(node, h, i % self.cp_degree, b)
                elif child.block_id != b:
                    self._give(child.rank, b)
                self._touch(child)
                out.append(child.block_id)
                node = child
            return out

    def _add(self, parent: _Node, h: int, rank: int, block_id: int) -> _Node:
        if h in self._nodes:
            raise ValueError(f"block hash {h:#x} is already cached under another parent")
        if block_id not in self._held[rank]:
            raise ValueError(f"block {block_id} on rank {rank} is not held by the caller")
        node = _Node(block_hash=h, parent=parent, depth=parent.depth + 1, rank=rank,
                     block_id=block_id)
        self._link(node)
        self._held[rank].discard(block_id)
        self._log(lambda: (self._unlink(node), self._held[rank].add(block_id)))
        self.events.append(CacheEvent(
            "insert", h, parent.block_hash if parent is not self._root else None, rank, block_id))
        return node

    def _link(self, node: _Node) -> None:
        node.parent.children[node.block_hash] = node
        self._nodes[node.block_hash] = node
        self._owner[node.rank][node.block_id] = node

    def _unlink(self, node: _Node) -> None:
        del node.parent.children[node.block_hash]
        del self._nodes[node.block_hash]
        del self._owner[node.rank][node.block_id]

    def _touch(self, node: _Node) -> None:
        old = node.last_access
        node.last_access = self._tick
        self._log(lambda: setattr(node, "last_access", old))
        self._push_if_evictable(node)

    def _push_if_evictable(self, node: _Node) -> None:
        if node.ref == 0 and not node.children and node is not self._root:
            self._seq += 1
            heapq.heappush(self._lru, (node.last_access, self._seq, node.block_hash))

    def _uncovers(self, node: _Node, ranks: set[int]) -> bool:
        """Whether evicting leaf `node` and then its unreferenced ancestors frees a block on
        one of `ranks`."""
        while node is not self._root and node.ref == 0:
            if node.rank in ranks:
                return True
            node = node.parent
        return False

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
                if fallback is None and self._uncovers(node, ranks):
                    fallback = node
        finally:
            for entry in skipped:
                heapq.heappush(self._lru, entry)
        if fallback is None:
            raise OutOfBlocksError(f"no evictable block for ranks {sorted(ranks or ())}")
        self._remove(fallback)

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        self._unlink(node)
        self._free[node.rank].add(node.block_id)
        heapq.heappush(self._free_heap[node.rank], node.block_id)
        self._log(lambda: (self._free[node.rank].discard(node.block_id), self._link(node)))
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
        path, out = self._walk(hashes), []
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
                cache._take(rank, ev.block_id)
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
