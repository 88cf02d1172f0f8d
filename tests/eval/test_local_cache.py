"""The simulator's per-worker LRU prefix cache."""

from __future__ import annotations

import pytest

from eval.local_cache import LocalPrefixCache
from serving.request import chain_block_hashes


def test_hit_insert_and_leaf_first_eviction():
    cache = LocalPrefixCache(capacity_blocks=6)
    a = chain_block_hashes([1, 2, 3, 4])
    hit, ev = cache.begin(a, max_blocks=3, total_blocks=4)
    assert (hit, ev) == (0, [])
    assert cache.free_blocks == 2
    assert cache.finish(a, 0, full_blocks=3, total_blocks=4) == list(reversed(a[:3]))
    assert len(cache) == 3 and cache.free_blocks == 3
    b = chain_block_hashes([1, 2, 9, 9, 9])  # shares 2 blocks with a
    hit, ev = cache.begin(b, max_blocks=4, total_blocks=5)
    # needs 3 new blocks: 3 cached + 3 reserved = 6, nothing evicted
    assert (hit, ev) == (2, [])
    cache.finish(b, 2, full_blocks=4, total_blocks=5)
    assert len(cache) == 5
    c = chain_block_hashes([5, 6, 7])
    hit, ev = cache.begin(c, max_blocks=2, total_blocks=3)
    # needs 3 blocks, 1 free -> evict 2 LRU blocks: the leaves a[2] (oldest) then b[3]
    assert hit == 0
    assert ev == [a[2], b[3]]
    assert a[0] in cache and a[1] in cache and b[2] in cache


def test_request_larger_than_cache_rejected_without_change():
    cache = LocalPrefixCache(2)
    a = chain_block_hashes([1, 2])
    cache.begin(a, 1, 2)
    cache.finish(a, 0, 2, 2)
    with pytest.raises(ValueError, match="capacity_blocks=2"):
        cache.begin(chain_block_hashes([1, 2, 3]), 2, 3)
    assert len(cache) == 2 and cache.free_blocks == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        LocalPrefixCache(0)


def test_child_counts_and_capacity_hold_under_random_operations():
    import numpy as np

    from eval.local_cache import split_cache

    rng = np.random.default_rng(5)
    chains = [chain_block_hashes([k] + list(range(100 * k, 100 * k + 12))) for k in range(6)]
    cache = LocalPrefixCache(30)

    cache.reclaim_suffix(chains[0][:1])  # starts child tracking (a no-op on an empty cache)

    def check(c):
        if c._children is None:
            return
        recount = {}
        for _, parent in c.blocks():
            if parent is not None:
                recount[parent] = recount.get(parent, 0) + 1
        assert c._children == recount
        assert len(c) <= c.capacity_blocks

    for step in range(400):
        chain = chains[int(rng.integers(len(chains)))]
        n = int(rng.integers(1, len(chain) + 1))
        op = int(rng.integers(4))
        if op == 0:
            hit, _ = cache.begin(chain[:n], n, n)
            cache.finish(chain[:n], hit, n, n)
        elif op == 1:
            cache.insert_chain(chain[:n])
        elif op == 2:
            cache.evict_blocks(chain[n - 1:n])
        else:
            freed = cache.reclaim_suffix(chain[:n])
            assert all(h not in cache for h in freed)
        check(cache)
    for half in split_cache(cache, 15):
        check(half)


def test_merged_caches_keep_parents_more_recent_than_children():
    a, b = LocalPrefixCache(10), LocalPrefixCache(10)
    shared = chain_block_hashes([1, 2])
    x = chain_block_hashes([3], shared[-1])
    y = chain_block_hashes([4, 5], shared[-1])
    a.insert_chain(shared)              # a: the shared prefix only, long ago
    a.insert_chain(chain_block_hashes([9]))
    b.insert_chain(shared + x)
    b.insert_chain(shared + y)          # b: two children of the shared prefix
    merged = LocalPrefixCache(20)
    for c in (a, b):  # a's older copy of the shared prefix goes in first
        merged.adopt(c.blocks())
    merged.restore_ancestor_order()
    pos = {h: i for i, (h, _) in enumerate(merged.blocks())}
    for h, parent in merged.blocks():
        if parent is not None and parent in pos:
            assert pos[parent] > pos[h]
    # Evicting down to 2 blocks keeps a root-first prefix, never a child without its parent.
    merged.capacity_blocks = 2
    merged.adopt([])
    kept = dict(merged.blocks())
    assert all(p is None or p in kept for p in kept.values())
