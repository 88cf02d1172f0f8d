"""Nodes of the prefix cache's radix tree and the read-only walks over them.

A node is one cached KV block: its chained block hash (the child key under its parent), its
depth (block index in its sequences), the rank `depth % C` and physical block id holding it,
its reference count and the logical tick of its last access. The root is a sentinel (depth -1,
no block). The functions here only read the tree; `vertumnus_jax.prefix_cache.PrefixCache`
changes it.

Source: SGLang RadixCache (page-aligned keys, lock refs, LRU of leaves).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(eq=False)
class RadixNode:
    """One cached block (or the root sentinel: parent None, depth -1, rank -1, block_id -1)."""

    block_hash: int
    parent: RadixNode | None
    depth: int
    rank: int
    block_id: int
    children: dict[int, RadixNode] = dataclasses.field(default_factory=dict)
    ref: int = 0
    last_access: int = 0


def walk(root: RadixNode, hashes: Sequence[int]) -> list[RadixNode]:
    """The nodes of the longest cached leading run of `hashes` from `root` (block i at depth i)."""
    path, node = [], root
    for h in hashes:
        node = node.children.get(int(h))
        if node is None:
            break
        path.append(node)
    return path


def cached_path(root: RadixNode, hashes: Sequence[int]) -> list[RadixNode]:
    """The nodes of `hashes`, which must all be a cached path from `root`.

    Raises KeyError naming the first hash (and its depth) that is not cached.
    """
    path = walk(root, hashes)
    if len(path) != len(hashes):
        raise KeyError(f"block hash {int(hashes[len(path)]):#x} at depth {len(path)} is "
                       "not cached")
    return path


def evictable_per_rank(root: RadixNode) -> collections.Counter:
    """Blocks per rank that eviction can free: nodes whose whole subtree is unreferenced."""
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    clear: dict[int, bool] = {}
    counts: collections.Counter = collections.Counter()
    for node in reversed(order):  # children before parents
        ok = node.ref == 0 and all(clear[id(c)] for c in node.children.values())
        clear[id(node)] = ok
        if ok and node is not root:
            counts[node.rank] += 1
    return counts


def uncovers(root: RadixNode, node: RadixNode, ranks: set[int]) -> bool:
    """Whether evicting leaf `node` and then its unreferenced ancestors (below `root`) frees a
    block on one of `ranks`."""
    while node is not root and node.ref == 0:
        if node.rank in ranks:
            return True
        node = node.parent
    return False
