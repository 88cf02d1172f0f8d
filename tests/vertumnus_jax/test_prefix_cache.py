"""Prefix cache: hash chain, leading-run matches, refcounts, LRU eviction, striping, events."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from serving.policy import request as serving_request
from serving.policy.request import chain_block_hashes
from vertumnus_jax.prefix_cache import (
    CacheEvent,
    OutOfBlocksError,
    PrefixCache,
    block_content_id,
    block_hashes,
    chain_hashes,
)

BS = 4


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def test_hash_chain_matches_serving_and_depends_on_whole_prefix():
    toks = _tokens(0, 3 * BS + 2)
    ids = [block_content_id(toks[i * BS:(i + 1) * BS]) for i in range(3)]
    hashes = block_hashes(toks, BS)
    assert len(hashes) == 3  # the partial block is not hashed
    assert hashes == chain_block_hashes(ids) == chain_hashes(ids)
    other = list(toks)
    other[0] += 1  # change only block 0: every later hash changes too
    assert all(a != b for a, b in zip(block_hashes(other, BS), hashes, strict=True))
    same_tail = other[:BS] + toks[BS:]
    assert block_hashes(same_tail, BS)[1:] != hashes[1:]


def test_serving_prompt_hashes_equal_the_cache_keys():
    """The live service hashes prompts with `serving.policy.request` (numpy only, by the layer rule);
    its full blocks must be exactly the workers' cache keys, its partial tail one more link."""
    for seed, n in ((1, 3 * BS), (2, 3 * BS + 1), (3, BS - 1), (4, 1)):
        toks = _tokens(seed, n)
        got = serving_request.prompt_block_hashes(toks, BS)
        assert len(got) == -(-n // BS)
        assert got[:n // BS] == block_hashes(toks, BS)
        for i in range(0, n, BS):
            assert serving_request.block_content_id(toks[i:i + BS]) == block_content_id(
                toks[i:i + BS])
        if n % BS:
            tail = block_content_id(toks[n - n % BS:])
            assert got[-1] == chain_hashes([tail], got[-2] if len(got) > 1 else 0)[0]
    with pytest.raises(ValueError, match="block_size"):
        serving_request.prompt_block_hashes([1, 2], 0)
    for bad in ([2**31, 1], [-1, 2], [[1, 2]], [1.5]):  # outside the int32 ids the cache keys use
        with pytest.raises(ValueError, match="token_ids"):
            serving_request.prompt_block_hashes(bad, BS)


def test_reuse_of_leading_blocks_and_no_hit_on_later_block_only():
    cache = PrefixCache(num_blocks=16, cp_degree=1)
    a = block_hashes(_tokens(1, 4 * BS), BS)
    ids = cache.allocate(0, 4)
    assert cache.insert(a, ids) == ids
    b_tokens = _tokens(1, 4 * BS)[:2 * BS] + _tokens(2, 2 * BS)  # shares blocks 0 and 1
    assert cache.match(block_hashes(b_tokens, BS)) == ids[:2]
    c_tokens = _tokens(3, BS) + _tokens(1, 4 * BS)[BS:]  # shares blocks 1.. but not block 0
    assert cache.match(block_hashes(c_tokens, BS)) == []
    # Precomputed hashes work the same: a chain with a foreign first link never matches.
    assert cache.match(chain_hashes([7, 8, 9])) == []


def test_striped_allocation_and_rank_of_cached_blocks():
    cache = PrefixCache(num_blocks=3, cp_degree=4)
    ids = cache.allocate(2, 6)  # sequence indices 2..7 -> ranks 2,3,0,1,2,3
    assert [cache.num_free(r) for r in range(4)] == [2, 2, 1, 1]
    hashes = chain_hashes(range(8))
    head = cache.allocate(0, 2)
    cache.insert(hashes, head + ids)
    state = cache.state()["nodes"]
    assert [state[h][1] for h in hashes] == [i % 4 for i in range(8)]


def test_lru_eviction_order_and_refcount_pinning():
    cache = PrefixCache(num_blocks=6, cp_degree=1)
    seqs = [chain_hashes([s * 100 + i for i in range(2)]) for s in range(3)]
    for h in seqs:  # three 2-block sequences fill the pool; inserted in order 0, 1, 2
        cache.insert(h, cache.allocate(0, 2))
    cache.match(seqs[0])  # sequence 0 becomes most recently used
    cache.lock(seqs[1])  # sequence 1 is pinned
    cache.drain_events()
    cache.allocate(0, 2)  # must evict sequence 2 (LRU, unpinned): leaf first, then its parent
    ev = cache.drain_events()
    assert [(e.kind, e.block_hash) for e in ev] == [("evict", seqs[2][1]), ("evict", seqs[2][0])]
    cache.allocate(0, 1)  # next: sequence 0's leaf, never the pinned sequence 1
    assert [(e.kind, e.block_hash) for e in cache.drain_events()] == [("evict", seqs[0][1])]
    assert seqs[1][0] in cache and seqs[1][1] in cache and cache.refcount(seqs[1][1]) == 1
    before = cache.state()
    with pytest.raises(OutOfBlocksError, match="rank 0: needs 3, free 0, evictable 1"):
        cache.allocate(0, 3)  # 1 evictable (seq 0 block 0) + 0 free < 3
    assert cache.state() == before and cache.drain_events() == []
    cache.unlock(seqs[1])
    assert cache.refcount(seqs[1][0]) == 0
    assert len(cache.allocate(0, 3)) == 3  # now everything is evictable


def test_out_of_blocks_on_one_rank_changes_nothing():
    cache = PrefixCache(num_blocks=2, cp_degree=2)
    h = chain_hashes(range(3))
    cache.insert(h, cache.allocate(0, 3))  # ranks 0, 1, 0: rank 0 full, rank 1 one free
    cache.lock(h)
    before = cache.state()
    with pytest.raises(OutOfBlocksError, match="rank 0: needs 1, free 0, evictable 0"):
        cache.allocate(0, 2)  # rank 1 could serve its block, rank 0 cannot: take nothing
    assert cache.state() == before and cache.num_free(1) == 1
    cache.unlock(h)
    cache.lock(h[:1])  # h[1] (rank 1) and h[2] (rank 0) become evictable
    cache.drain_events()
    assert len(cache.allocate(0, 2)) == 2  # rank 0 short by one: evicts the LRU leaf h[2] only
    assert [(e.kind, e.block_hash, e.rank) for e in cache.drain_events()] == [
        ("evict", h[2], 0)]


def test_lock_errors():
    cache = PrefixCache(num_blocks=4, cp_degree=1)
    h = chain_hashes([1, 2])
    with pytest.raises(KeyError):
        cache.lock(h)
    cache.insert(h, cache.allocate(0, 2))
    with pytest.raises(ValueError, match="refcount is 0"):
        cache.unlock(h)
    held = cache.allocate(0, 1)[0]
    with pytest.raises(ValueError, match="twice"):
        cache.free(0, [held, held])
    assert not cache.is_free(0, held)  # nothing freed by the rejected call
    cache.free(0, [held])
    with pytest.raises(ValueError, match="already free"):
        cache.free(0, [held])


def test_event_stream_replays_to_same_state():
    rng = np.random.default_rng(7)
    cache = PrefixCache(num_blocks=10, cp_degree=2)
    locked = []
    for _ in range(200):
        # Random prompts over a small alphabet of block contents so prefixes are shared.
        n = int(rng.integers(1, 6))
        hashes = chain_hashes(rng.integers(0, 3, n).tolist())
        hit = cache.match(hashes)
        try:
            new = cache.allocate(len(hit), n - len(hit))
        except OutOfBlocksError:
            continue
        cache.insert(hashes, hit + new)
        if rng.random() < 0.3:
            cache.lock(hashes)
            locked.append(hashes)
        if locked and rng.random() < 0.4:
            cache.unlock(locked.pop(int(rng.integers(len(locked)))))
    events = list(cache.events)
    assert {e.kind for e in events} == {"insert", "evict"}
    replayed = PrefixCache.replay(10, 2, events)
    assert replayed.state() == cache.state()
    assert len(replayed) == len(cache) > 0


def _snapshot(cache):
    refs = {h: cache.refcount(h) for h in cache.state()["nodes"]}
    return cache.state(), refs, list(cache.events)


def test_free_rejects_cached_blocks_and_insert_validates_first():
    cache = PrefixCache(num_blocks=4, cp_degree=1)
    h = chain_hashes([1, 2])
    ids = cache.allocate(0, 2)
    cache.insert(h, ids)
    spare = cache.allocate(0, 1)
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=f"block {ids[0]} on rank 0 is cached"):
        cache.free(0, [ids[0]])  # owned by the tree: freeing it would alias a cached block
    with pytest.raises(ValueError, match="repeats at index 1"):
        cache.insert([5, 5], spare + spare)
    with pytest.raises(ValueError, match=f"{h[1]:#x} at index 0 is already cached under "
                                         "another parent"):
        cache.insert([h[1]], spare)
    with pytest.raises(ValueError, match="already free"):
        cache.insert([7], [3])  # block 3 was never allocated
    with pytest.raises(ValueError, match="is cached"):
        cache.insert([7], [ids[1]])  # a block the tree owns under another hash
    assert _snapshot(cache) == before
    assert cache.insert([7], spare) == spare  # the held block is still the caller's


def test_unlock_of_a_path_that_was_not_locked_is_rejected():
    cache = PrefixCache(num_blocks=2, cp_degree=1)
    h = chain_hashes([1, 2])
    cache.insert(h, cache.allocate(0, 2))
    cache.lock(h)
    with pytest.raises(ValueError, match="below its children's 1"):
        cache.unlock(h[:1])  # would leave the parent unreferenced under a referenced child
    assert [cache.refcount(x) for x in h] == [1, 1]
    before = _snapshot(cache)
    with pytest.raises(OutOfBlocksError, match="evictable 0"):
        cache.allocate(0, 1)
    assert _snapshot(cache) == before
    cache.lock(h[:1])  # a lock of the prefix alone may be undone alone
    cache.unlock(h[:1])
    cache.unlock(h)
    assert [cache.refcount(x) for x in h] == [0, 0] and len(cache.allocate(0, 2)) == 2


def test_eviction_frees_only_blocks_of_the_short_rank():
    cache = PrefixCache(num_blocks=2, cp_degree=2)
    x = chain_hashes([10])  # rank 0, least recently used
    y = chain_hashes([20, 21])  # ranks 0, 1
    cache.insert(x, cache.allocate(0, 1))
    cache.insert(y, cache.allocate(0, 2))
    cache.allocate(1, 1)  # rank 1's last free block
    cache.drain_events()
    cache.allocate(1, 1)  # rank 1 short: the global LRU leaf x (rank 0) would not help
    assert [(e.kind, e.block_hash, e.rank) for e in cache.drain_events()] == [
        ("evict", y[1], 1)]
    assert x[0] in cache and y[0] in cache

    # No leaf on the short rank: evict the LRU leaf that uncovers one, not the global LRU leaf.
    cache = PrefixCache(num_blocks=2, cp_degree=2)
    a, b = chain_hashes([1, 2]), chain_hashes([3, 4])  # ranks 0, 1 each; a older
    cache.insert(a, cache.allocate(0, 2))
    cache.insert(b, cache.allocate(0, 2))
    cache.lock(a[:1])  # a[1] stays evictable but freeing it uncovers no rank-0 block
    cache.drain_events()
    cache.allocate(0, 1)
    assert [(e.block_hash, e.rank) for e in cache.drain_events()] == [(b[1], 1), (b[0], 0)]
    assert a[1] in cache


def test_failed_transaction_restores_tree_refcounts_lru_and_events():
    cache = PrefixCache(num_blocks=4, cp_degree=2)
    seqs = [chain_hashes([s, s + 1, s + 2]) for s in (0, 10)]
    for h in seqs:
        cache.insert(h, cache.allocate(0, 3))
    twin = copy.deepcopy(cache)
    before = _snapshot(cache)
    with pytest.raises(RuntimeError, match="boom"), cache.transaction():
        cache.match(seqs[0])  # would make seqs[1] the LRU sequence
        cache.lock(seqs[0][:1])
        new = cache.allocate(0, 3)  # evicts
        cache.insert(chain_hashes([99, 98, 97]), new)
        raise RuntimeError("boom")
    assert _snapshot(cache) == before
    for c in (cache, twin):  # afterwards both evict alike (LRU ages were restored too)
        c.drain_events()
        c.allocate(0, 2)
    assert cache.drain_events() == twin.drain_events() != []


def test_replay_rejects_inconsistent_events():
    good = [CacheEvent("insert", 1, None, 0, 0), CacheEvent("insert", 2, 1, 1, 0)]
    assert PrefixCache.replay(2, 2, good).state()["nodes"] == {1: (None, 0, 0), 2: (1, 1, 0)}
    bad = {
        "must be on rank 1": good[:1] + [CacheEvent("insert", 2, 1, 0, 1)],
        "already cached": good + [CacheEvent("insert", 2, None, 0, 1)],
        r"block id must be in \[0, 2\)": [CacheEvent("insert", 1, None, 0, 7)],
        "differ from the cached": good + [CacheEvent("evict", 2, 1, 1, 1)],  # wrong block
        "differ from the cached ": good + [CacheEvent("evict", 2, None, 1, 0)],  # parent
        "not a leaf": good + [CacheEvent("evict", 1, None, 0, 0)],
    }
    for message, events in bad.items():
        with pytest.raises(ValueError, match=message.strip()):
            PrefixCache.replay(2, 2, events)
