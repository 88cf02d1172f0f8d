"""The simulator's per-worker LRU prefix cache."""

from __future__ import annotations

import pytest

from eval.sim.local_cache import LocalPrefixCache
from serving.policy.request import chain_block_hashes


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

    from eval.sim.local_cache import split_cache

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


class _ReferenceLRU:
    """The cache's semantics written plainly (a list, oldest first; every touch eager), to
    check the optimised `LocalPrefixCache` against."""

    def __init__(self, capacity):
        self.capacity, self.order, self.parent, self.reserved = capacity, [], {}, 0

    def _touch(self, h):
        self.order.remove(h)
        self.order.append(h)

    def _evict_lru(self, n):
        out = self.order[:max(n, 0)]
        for h in out:
            self.order.remove(h)
            del self.parent[h]
        return out

    def begin(self, chain, max_blocks, total):
        hit = 0
        while hit < min(max_blocks, len(chain)) and chain[hit] in self.parent:
            hit += 1
        for h in reversed(chain[:hit]):
            self._touch(h)
        need = total - hit
        evicted = self._evict_lru(len(self.order) + self.reserved + need - self.capacity)
        self.reserved += need
        return hit, evicted

    def _put(self, chain, lo, hi):
        """Blocks hi-1 .. lo of `chain`, last first: touched if cached, else appended."""
        inserted = []
        for k in range(hi - 1, lo - 1, -1):
            if chain[k] in self.parent:
                self._touch(chain[k])
            else:
                self.order.append(chain[k])
                self.parent[chain[k]] = chain[k - 1] if k else None
                inserted.append(chain[k])
        return inserted

    def finish(self, chain, hit, full, total):
        self.reserved -= total - hit
        inserted = self._put(chain, hit, full)
        for h in reversed(chain[:hit]):
            if h in self.parent:
                self._touch(h)
        return inserted

    def insert_chain(self, chain):
        if len(chain) > self.capacity - self.reserved:
            return [], []
        inserted = self._put(chain, 0, len(chain))
        return inserted, self._evict_lru(len(self.order) + self.reserved - self.capacity)

    def evict_blocks(self, hashes):
        out = [h for h in hashes if h in self.parent]
        for h in out:
            self.order.remove(h)
            del self.parent[h]
        return out

    def reclaim_suffix(self, chain):
        out = []
        for h in reversed(chain):
            if h not in self.parent or h in self.parent.values():
                break
            self.order.remove(h)
            del self.parent[h]
            out.append(h)
        return out

    def blocks(self):
        return [(h, self.parent[h]) for h in self.order]


def test_matches_a_plain_reference_under_random_operations():
    """Every result and the full recency order agree with `_ReferenceLRU` after each step of
    seeded random prefills, with copies, evictions and reclaims also while a prefill runs."""
    import numpy as np

    rng = np.random.default_rng(11)
    roots = [chain_block_hashes([k] + list(range(50 * k, 50 * k + 10))) for k in range(5)]
    chains = roots + [chain_block_hashes(list(range(900 + 7 * k, 904 + 7 * k)), roots[k % 5][3])
                      for k in range(5)]  # branches off the roots' fourth block
    for capacity in (6, 12, 25):
        cache, ref = LocalPrefixCache(capacity), _ReferenceLRU(capacity)
        running = None  # (chain, hit, full blocks, total blocks) of the prefill in progress
        for step in range(800):
            op = int(rng.integers(6))
            chain = chains[int(rng.integers(len(chains)))]
            n = int(rng.integers(1, len(chain) + 1))
            if op <= 1 and running is None and n <= capacity:
                total = n
                full = n - int(rng.integers(2))  # a partial last block half the time
                got = cache.begin(chain[:n], max(total - 1, 0), total)
                assert got == ref.begin(chain[:n], max(total - 1, 0), total), f"step {step}"
                running = (chain[:n], got[0], full, total)
            elif op <= 2 and running is not None:
                c, hit, full, total = running
                assert cache.finish(c, hit, full, total) == ref.finish(c, hit, full, total)
                running = None
            elif op == 3:
                assert cache.insert_chain(chain[:n]) == ref.insert_chain(chain[:n])
            elif op == 4:
                assert cache.evict_blocks(chain[n - 1:n]) == ref.evict_blocks(chain[n - 1:n])
            elif op == 5:
                assert cache.reclaim_suffix(chain[:n]) == ref.reclaim_suffix(chain[:n])
            if running is None or step % 5 == 0:
                assert cache.blocks() == ref.blocks(), f"capacity {capacity}, step {step}"
            assert len(cache) == len(ref.order)
            assert cache.free_blocks == capacity - len(ref.order) - ref.reserved


def test_cyclic_parent_links_are_refused_instead_of_looping():
    cache = LocalPrefixCache(4)
    cache.adopt([(5, 6), (6, 5)])
    with pytest.raises(ValueError, match="cycle"):
        cache.restore_ancestor_order()
    assert cache.blocks() == [(5, 6), (6, 5)]  # unchanged


def test_split_into_parts_is_the_halving_that_makes_them():
    # A CP-8 worker's cache (10 blocks a GPU) into [2, 2, 4]: what halving it (40 blocks
    # each), then its lower half (20 each), gives; every block kept lands in one part.
    from eval.sim.local_cache import split_cache, split_cache_parts

    def filled():
        cache = LocalPrefixCache(80)
        for i in range(12):  # 12 prompts of 1-6 blocks, some sharing a first block
            hashes = chain_block_hashes([i % 4 * 1000] + [i * 100 + k for k in range(i % 6)])
            n = len(hashes)
            hit, _ = cache.begin(hashes, max_blocks=n, total_blocks=n)
            cache.finish(hashes, hit, full_blocks=n, total_blocks=n)
        return cache
    cache = filled()
    before = {h for h, _ in cache.blocks()}
    parts = split_cache_parts(cache, [2, 2, 4], 10)
    lower, upper = split_cache(filled(), 40)
    ref = [*split_cache(lower, 20), upper]
    assert [p.blocks() for p in parts] == [r.blocks() for r in ref]
    held = [{h for h, _ in p.blocks()} for p in parts]
    assert [p.capacity_blocks for p in parts] == [20, 20, 40]
    assert set().union(*held) == before and sum(map(len, held)) == len(before)
    assert split_cache_parts(filled(), [8], 10)[0].blocks() == filled().blocks()
    for bad in ([2, 4, 2], [4, 2], []):
        with pytest.raises(ValueError, match="parts must be"):
            split_cache_parts(filled(), bad, 10)
