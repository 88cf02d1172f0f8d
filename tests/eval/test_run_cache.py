"""`eval.run_cache.RunPrefixCache` against `eval.local_cache.LocalPrefixCache`, block for block.

The plain-list reference of the LRU semantics is in test_local_cache.py (both classes are run
against it there); here the operations that reference does not have (merging caches with
`adopt` + `restore_ancestor_order`, `split_cache`) and the run structure's own invariants.
"""

from __future__ import annotations

import numpy as np
import pytest

from eval.local_cache import LocalPrefixCache, split_cache
from eval.run_cache import RunPrefixCache
from serving.request import chain_block_hashes


def _chains(seed: int) -> list[tuple[int, ...]]:
    """Hash chains sharing prefixes: 4 roots of 10 blocks, 8 branches of 3-6 blocks off them."""
    rng = np.random.default_rng(seed)
    roots = [chain_block_hashes([1000 * k + j for j in range(10)]) for k in range(4)]
    out = list(roots)
    for b in range(8):
        root = roots[int(rng.integers(4))]
        at = int(rng.integers(1, 10))
        out.append(root[:at] + chain_block_hashes(
            [50_000 + 100 * b + j for j in range(int(rng.integers(3, 7)))], root[at - 1]))
    return out


def _check_structure(cache: RunPrefixCache) -> None:
    """The run structure's invariants: every cached block in exactly one run, heads index the
    runs, branch counts equal the runs hanging off each block, the live view is the cache."""
    blocks = [h for run in cache._runs.values() for h in run.blocks]
    assert len(blocks) == len(set(blocks)) == len(cache)
    assert set(blocks) == set(cache.block_view())
    assert {run.blocks[0]: run for run in cache._runs.values()} == cache._heads
    branches: dict = {}
    for run in cache._runs.values():
        assert run.blocks  # no empty run
        if run.parent is not None:
            branches[run.parent] = branches.get(run.parent, 0) + 1
    assert branches == cache._branches


@pytest.mark.parametrize("seed", [3, 4])
def test_same_results_and_order_as_local_cache_with_merges_and_splits(seed):
    rng = np.random.default_rng(seed)
    chains = _chains(seed)
    fast = [RunPrefixCache(20), RunPrefixCache(20)]
    slow = [LocalPrefixCache(20), LocalPrefixCache(20)]
    running: list = [None, None]
    for step in range(600):
        w = int(rng.integers(2))
        a, b, op = fast[w], slow[w], int(rng.integers(8))
        chain = chains[int(rng.integers(len(chains)))]
        n = int(rng.integers(1, len(chain) + 1))
        if op <= 2 and running[w] is None:
            full = n - int(rng.integers(2))
            got = a.begin(chain[:n], max(n - 1, 0), n)
            assert got == b.begin(chain[:n], max(n - 1, 0), n), step
            running[w] = (chain[:n], got[0], full, n)
        elif op <= 3 and running[w] is not None:
            assert a.finish(*running[w]) == b.finish(*running[w]), step
            running[w] = None
        elif op == 4:
            assert a.insert_chain(chain[:n]) == b.insert_chain(chain[:n]), step
        elif op == 5:
            assert a.reclaim_suffix(chain[:n]) == b.reclaim_suffix(chain[:n]), step
        elif op == 6:
            assert a.evict_blocks(chain[n - 1:n]) == b.evict_blocks(chain[n - 1:n]), step
        elif op == 7 and running == [None, None]:
            # Merge the two workers' caches, then split the result again (a re-carve).
            merged_a, merged_b = RunPrefixCache(40), LocalPrefixCache(40)
            for x, y in zip(fast, slow):
                assert merged_a.adopt(x.blocks()) == merged_b.adopt(y.blocks())
            merged_a.restore_ancestor_order()
            merged_b.restore_ancestor_order()
            assert merged_a.blocks() == merged_b.blocks(), step
            fast, slow = list(split_cache(merged_a, 20)), list(split_cache(merged_b, 20))
            assert all(type(c) is RunPrefixCache for c in fast)
        for x, y in zip(fast, slow):
            assert x.blocks() == y.blocks(), step
            assert x.free_blocks == y.free_blocks
            _check_structure(x)


def test_a_growing_conversation_stays_one_run():
    """Each turn's prefill hits the previous turns and adds blocks: one run, touched whole."""
    cache = RunPrefixCache(100)
    chain = chain_block_hashes(list(range(40)))
    for turn in range(1, 5):
        n = 10 * turn
        hit, evicted = cache.begin(chain[:n], n - 1, n)
        assert (hit, evicted) == (10 * (turn - 1), [])
        assert cache.finish(chain[:n], hit, n, n) == list(chain[hit:n][::-1])
        assert [run.blocks for run in cache._runs.values()] == [chain[:n]]


def test_not_a_hash_chain_is_refused_and_nothing_changes():
    cache = RunPrefixCache(10)
    a = chain_block_hashes([1, 2, 3])
    cache.insert_chain(a)
    before = cache.blocks()
    with pytest.raises(ValueError, match="not a hash chain"):
        cache.insert_chain((77, 78, 77))  # a hash repeats
    with pytest.raises(ValueError, match="not a hash chain"):
        cache.insert_chain((99, a[1]))  # a[1] is cached with parent a[0], not 99
    assert cache.blocks() == before
    hit, _ = cache.begin(a + (55, 55), 4, 5)  # a prefill of 2 new blocks, one hash twice
    before = cache.blocks()
    with pytest.raises(ValueError, match="not a hash chain"):
        cache.finish(a + (55, 55), hit, 5, 5)
    assert cache.blocks() == before and cache.free_blocks == 10 - 3 - 2  # still reserved
    _check_structure(cache)


def test_edge_cases_found_in_review():
    # finish with fewer full blocks than the hit: the hit is touched, as LocalPrefixCache does
    caches = [RunPrefixCache(4), LocalPrefixCache(4)]
    for c in caches:
        c.insert_chain((1, 2))
        c.insert_chain((5,))
        hit, _ = c.begin((1, 2), 2, 2)
        c.insert_chain((5,))
        assert c.finish((1, 2), hit, 1, 2) == []
    assert caches[0].blocks() == caches[1].blocks()
    # a reclaim whose chain contradicts the runs fails before evicting anything
    c = RunPrefixCache(5)
    ch = chain_block_hashes([1, 2, 3])
    c.insert_chain(ch)
    hit, _ = c.begin(ch[:2], 2, 2)
    c.finish(ch[:2], hit, 2, 2)
    before = c.blocks()
    for bad in (ch[1:], (ch[0], 999, ch[2])):
        with pytest.raises(ValueError, match="not a hash chain"):
            c.reclaim_suffix(bad)
        assert c.blocks() == before
    # a hash repeated at a position evicted since the prefill began
    c = RunPrefixCache(3)
    c.insert_chain((1,))
    hit, _ = c.begin((1, 3, 1), 1, 3)
    c.evict_blocks((1,))
    before = c.blocks()
    with pytest.raises(ValueError, match="not a hash chain"):
        c.finish((1, 3, 1), hit, 3, 3)
    assert c.blocks() == before
    # cyclic parent links are refused by both classes instead of looping
    for cls in (RunPrefixCache, LocalPrefixCache):
        c = cls(4)
        c.adopt([(5, 6), (6, 5)])
        with pytest.raises(ValueError, match="cycle"):
            c.restore_ancestor_order()
