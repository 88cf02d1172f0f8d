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
its owner (`allocate` / `free`) without entering the tree.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
from collections.abc import Iterable, Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def chain_hashes(content_ids: Iterable[int], parent: int = 0) -> tuple[int, ...]:
    """Chains per-block content ids: `h[k] = splitmix64((h[k-1] * 31) ^ splitmix64(id[k]))`.

    The same formula as `serving.request.chain_block_hashes` (64-bit, deterministic across
    processes), so hashes computed by the scheduler can be passed in precomputed.
    """
    out, h = [], int(parent) & _MASK64
    for c in content_ids:
        h = _splitmix64(((h * 31) & _MASK64) ^ _splitmix64(int(c) & _MASK64))
        out.append(h)
    return tuple(out)


def block_content_id(tokens: Sequence[int]) -> int:
    """64-bit id of one block's token ids: BLAKE2b-64 of their little-endian int32 bytes."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> tuple[int, ...]:
    """Chained hashes of the *full* blocks of a prompt: `len(token_ids) // block_size` ints.

    Raises ValueError for `block_size < 1`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    toks = np.asarray(token_ids, dtype=np.int64)
    n = len(toks) // block_size
    return chain_hashes((block_content_id(toks[i * block_size:(i + 1) * block_size])
                         for i in range(n)), parent)


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
        return len(self._free[rank])

    def refcount(self, block_hash: int) -> int:
        """Reference count of a cached block (KeyError when not cached)."""
        return self._nodes[block_hash].ref

    def block_id(self, block_hash: int) -> int:
        """Physical block id of a cached block (KeyError when not cached)."""
        return self._nodes[block_hash].block_id

    def state(self) -> dict:
        """Canonical contents: {"nodes": {hash: (parent_hash, rank, block_id)}, "free": per-rank
        sorted free ids}. Equal states mean equal trees and allocations."""
        nodes = {h: (n.parent.block_hash if n.parent is not self._root else None, n.rank,
                     n.block_id) for h, n in self._nodes.items()}
        return {"nodes": nodes, "free": tuple(tuple(sorted(f)) for f in self._free)}

    def _walk(self, hashes: Sequence[int]) -> list[_Node]:
        path, node = [], self._root
        for h in hashes:
            node = node.children.get(int(h))
            if node is None:
                break
            path.append(node)
        return path

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached leading run of `hashes` (block i on rank i % C).

        Marks the matched blocks as accessed now (LRU). Does not lock them.
        """
        path = self._walk(hashes)
        self._tick += 1
        for node in path:
            self._touch(node)
        return [n.block_id for n in path]

    # ---- reference counts ---------------------------------------------------------------------
    def lock(self, hashes: Sequence[int]) -> None:
        """Pins every block of the cached path `hashes` (refcount + 1) against eviction.

        Raises KeyError when `hashes` is not entirely a cached path from the root.
        """
        path = self._path_or_raise(hashes)
        for node in path:
            node.ref += 1

    def unlock(self, hashes: Sequence[int]) -> None:
        """Undoes one `lock(hashes)`.

        Raises KeyError on an uncached path, ValueError on a block whose refcount is 0.
        """
        path = self._path_or_raise(hashes)
        if any(n.ref < 1 for n in path):
            raise ValueError("unlock of a block whose refcount is 0")
        for node in path:
            node.ref -= 1
            self._push_if_evictable(node)

    def _path_or_raise(self, hashes):
        path = self._walk(hashes)
        if len(path) != len(hashes):
            raise KeyError(f"block hash {int(hashes[len(path)]):#x} at depth {len(path)} is "
                           "not cached")
        return path

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, first_index: int, count: int) -> list[int]:
        """Free blocks for sequence indices `first_index .. first_index + count - 1`.

        Block i comes from rank `i % C`. When a rank is short, unreferenced leaves are evicted in
        LRU order (over all ranks) until every rank has enough. The caller owns the returned
        blocks until it `insert`s or `free`s them.

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
            evictable = collections.Counter(n.rank for n in self._nodes.values() if n.ref == 0)
            lacking = {r: s - evictable[r] for r, s in short.items() if s > evictable[r]}
            if lacking:
                detail = ", ".join(
                    f"rank {r}: needs {need[r]}, free {len(self._free[r])}, evictable "
                    f"{evictable[r]}" for r in sorted(lacking))
                raise OutOfBlocksError(f"out of KV blocks ({self.num_blocks} per rank): {detail}")
            while any(len(self._free[r]) < need[r] for r in need):
                self._evict_one()
        return [self._take((first_index + k) % c) for k in range(count)]

    def free(self, first_index: int, block_ids: Sequence[int]) -> None:
        """Returns owned, uncached blocks (block k at sequence index `first_index + k`).

        Raises ValueError for a block that is already free or out of range.
        """
        for k, b in enumerate(block_ids):
            self._give((first_index + k) % self.cp_degree, int(b))

    def _take(self, rank: int, block_id: int | None = None) -> int:
        free = self._free[rank]
        if block_id is not None:
            if block_id not in free:
                raise ValueError(f"block {block_id} on rank {rank} is not free")
            free.discard(block_id)
            return block_id
        heap = self._free_heap[rank]
        while True:
            b = heapq.heappop(heap)
            if b in free:
                free.discard(b)
                return b

    def _give(self, rank: int, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be in [0, {self.num_blocks}), got {block_id}")
        if block_id in self._free[rank]:
            raise ValueError(f"block {block_id} on rank {rank} is already free")
        self._free[rank].add(block_id)
        heapq.heappush(self._free_heap[rank], block_id)

    # ---- insertion and eviction ---------------------------------------------------------------
    def insert(self, hashes: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        """Caches the path `hashes` (from the root) whose blocks are `block_ids`.

        Blocks already cached keep their block; a given block that duplicates a cached one is
        freed (the caller must own it). New blocks pass from the caller to the cache.

        Returns:
          The cached block id of every hash (the existing ones where already cached).

        Raises ValueError when the lengths differ.
        """
        if len(hashes) != len(block_ids):
            raise ValueError(f"hashes ({len(hashes)}) and block_ids ({len(block_ids)}) differ "
                             "in length")
        self._tick += 1
        node, out = self._root, []
        for i, (h, b) in enumerate(zip(hashes, block_ids, strict=True)):
            h, b = int(h), int(b)
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
        node = _Node(block_hash=h, parent=parent, depth=parent.depth + 1, rank=rank,
                     block_id=block_id)
        parent.children[h] = node
        self._nodes[h] = node
        self.events.append(CacheEvent(
            "insert", h, parent.block_hash if parent is not self._root else None, rank, block_id))
        return node

    def _touch(self, node: _Node) -> None:
        node.last_access = self._tick
        self._push_if_evictable(node)

    def _push_if_evictable(self, node: _Node) -> None:
        if node.ref == 0 and not node.children and node is not self._root:
            self._seq += 1
            heapq.heappush(self._lru, (node.last_access, self._seq, node.block_hash))

    def _evict_one(self) -> None:
        while self._lru:
            access, _, h = heapq.heappop(self._lru)
            node = self._nodes.get(h)
            if node is None or node.ref or node.children or node.last_access != access:
                continue  # stale entry
            self._remove(node)
            return
        raise AssertionError("no evictable leaf although the feasibility check passed")

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.block_hash]
        del self._nodes[node.block_hash]
        self._give(node.rank, node.block_id)
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

    def drain_events(self) -> list[CacheEvent]:
        """Returns and clears the events since the last drain."""
        out, self.events = self.events, []
        return out

    @classmethod
    def replay(cls, num_blocks: int, cp_degree: int, events: Iterable[CacheEvent]
               ) -> PrefixCache:
        """A fresh cache with `events` applied in order (same tree and free lists).

        Raises ValueError on an event inconsistent with the state (unknown parent, block not
        free, eviction of an unknown block or of a non-leaf).
        """
        cache = cls(num_blocks, cp_degree)
        for ev in events:
            if ev.kind == "insert":
                parent = cache._root if ev.parent_hash is None else cache._nodes.get(ev.parent_hash)
                if parent is None:
                    raise ValueError(f"insert of {ev.block_hash:#x} under unknown parent")
                cache._take(ev.rank, ev.block_id)
                cache._tick += 1
                cache._touch(cache._add(parent, ev.block_hash, ev.rank, ev.block_id))
            elif ev.kind == "evict":
                node = cache._nodes.get(ev.block_hash)
                if node is None or node.children:
                    raise ValueError(f"evict of {ev.block_hash:#x}: unknown block or not a leaf")
                cache._remove(node)
            else:
                raise ValueError(f"event kind must be 'insert' or 'evict', got {ev.kind!r}")
        return cache
