"""Zigzag CP prefill on submeshes of 1, 2, 4, 8 devices against a plain single-device prefill.

Per CP degree one worker runs three requests that together cover cached prefixes of 0 blocks,
some blocks (a prompt sharing the first 5 blocks), and all but the last partial block (the same
prompt again), each checked against `full_prefill` (dense jnp attention) of the whole prompt:
first token equal, last-position logits within 1e-5, and the pool's K/V of every position.
Prompts are 200 tokens with 16-token blocks: 12 full blocks and a partial one of 8 tokens.
"""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from mesh import worker_mesh
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import full_prefill, init_model
from vertumnus_jax.prefill import (
    as_token_ids,
    bucket_length,
    prefill,
    prefill_request,
    release_request,
    zigzag_indices,
)
from vertumnus_jax.prefix_cache import OutOfBlocksError, block_hashes
from vertumnus_jax.worker import Worker

BS, LEN, SHARED = 16, 200, 5  # block size, prompt length, blocks shared by prompts A and B


@pytest.fixture(scope="module")
def model():
    return init_model(ModelConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, LEN)
    b = np.concatenate([a[:SHARED * BS], rng.integers(0, 256, LEN - SHARED * BS)])
    refs = {}
    for name, toks in (("a", a), ("b", b)):
        logits, k, v = full_prefill(model, toks)
        refs[name] = (toks, np.asarray(logits[-1]), np.asarray(k), np.asarray(v))
    return refs


def _check(worker, result, ref, cached_blocks):
    toks, logits, k, v = ref
    assert result.cached_blocks == cached_blocks
    assert result.cached_tokens == cached_blocks * BS
    assert result.first_token == int(np.argmax(logits))
    np.testing.assert_allclose(result.logits, logits, atol=1e-5, rtol=0)
    assert len(result.block_ids) == -(-LEN // BS)
    pool_k, pool_v = worker.pool.read_sequence(result.block_ids)
    np.testing.assert_allclose(pool_k[:, :LEN], k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(pool_v[:, :LEN], v, atol=1e-5, rtol=0)


def _pointers(arr):
    return sorted(s.data.unsafe_buffer_pointer() for s in arr.addressable_shards)


@pytest.mark.parametrize("first,cp", [(5, 1), (2, 2), (4, 4), (0, 8)])
def test_cp_prefill_equals_single_device_prefill(model, prompts, first, cp):
    worker = Worker(worker_mesh(jax.devices(), first, cp), model, num_blocks=32, block_size=BS)
    assert worker.device_ids == tuple(range(first, first + cp))
    pointers = (_pointers(worker.pool.k), _pointers(worker.pool.v))

    cold = prefill_request(worker, prompts["a"][0])  # nothing cached
    _check(worker, cold, prompts["a"], 0)
    warm = prefill_request(worker, prompts["a"][0])  # all but the partial last block cached
    _check(worker, warm, prompts["a"], LEN // BS)
    assert warm.block_ids[:LEN // BS] == cold.block_ids[:LEN // BS]
    assert warm.block_ids[-1] != cold.block_ids[-1]  # each request owns its partial block
    shared = prefill_request(worker, prompts["b"][0])  # first 5 blocks cached
    _check(worker, shared, prompts["b"], SHARED)
    assert shared.block_ids[:SHARED] == cold.block_ids[:SHARED]

    # Striping: block i of the prompt was written on rank i % C (read back rank by rank).
    for i, b in enumerate(cold.block_ids[:3]):
        on_rank = np.asarray(worker.pool.rank_arrays(i % cp)[0])[:, b, :BS]
        np.testing.assert_allclose(on_rank, prompts["a"][2][:, i * BS:(i + 1) * BS], atol=1e-5)
    # The pool was updated in place, and one executable per (device set, C, N, J) bucket.
    assert (_pointers(worker.pool.k), _pointers(worker.pool.v)) == pointers
    assert len(worker.executables) == 3
    for r in (cold, warm, shared):
        release_request(worker, r)
    assert all(worker.cache.refcount(h) == 0 for h in block_hashes(prompts["a"][0], BS))
    again = prefill_request(worker, prompts["b"][0])  # a full hit up to the partial block
    assert again.cached_blocks == LEN // BS and len(worker.executables) == 3


def test_zigzag_layout_and_buckets():
    idx = zigzag_indices(16, 4)  # 8 chunks of 2: rank r holds chunks r and 7 - r
    assert idx.tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(idx.reshape(-1).tolist()) == list(range(16))
    assert bucket_length(200, 8, 16) == 256 and bucket_length(8, 8, 16) == 16
    assert bucket_length(3, 1, 4, min_bucket=1) == 4


def test_out_of_blocks_and_bad_input_leave_worker_unchanged(model):
    worker = Worker(worker_mesh(jax.devices(), 6, 2), model, num_blocks=4, block_size=BS)
    toks = np.arange(LEN) % 256  # 13 blocks: 7 on rank 0 > 4
    before = worker.cache.state()
    with pytest.raises(OutOfBlocksError, match="rank 0: needs 7, free 4"):
        prefill_request(worker, toks)
    assert worker.cache.state() == before and worker.cache.drain_events() == []
    with pytest.raises(ValueError, match="shorter than the prompt"):
        prefill(worker, toks[:32], [0, 1])
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        prefill(worker, [3, 256], [])
    with pytest.raises(ValueError, match="block_hashes must have 12 or 13"):
        prefill_request(worker, toks, block_hashes=[1, 2])
    assert worker.cache.state() == before


def _snapshot(cache):
    refs = {h: cache.refcount(h) for h in cache.state()["nodes"]}
    return cache.state(), refs, list(cache.events)


def _small_worker(model, device, num_blocks):
    return Worker(worker_mesh(jax.devices(), device, 1), model, num_blocks=num_blocks,
                  block_size=4)


def _fill(cache, *token_lists):
    """Caches each prompt's full blocks in order (older first), unreferenced."""
    hashes = []
    for toks in token_lists:
        h = block_hashes(toks, 4)
        cache.insert(h, cache.allocate(0, len(h)))
        hashes.append(h)
    return hashes


def test_bad_tokens_and_hashes_are_rejected_before_any_change(model):
    worker = _small_worker(model, 1, 8)
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, 8)
    ha = _fill(worker.cache, a)[0]
    before = _snapshot(worker.cache)
    bad_tokens = [None, 5, "ab", [], [1.0, 2.0], [True, 3], np.arange(8).reshape(4, 2),
                  np.array([1.5]), [[1, 2]], [2 ** 70], [3, 256], [-1]]
    for toks in bad_tokens:
        with pytest.raises(ValueError, match="token_ids"):
            prefill_request(worker, toks)
    toks = np.concatenate([a, rng.integers(0, 256, 5)])  # 3 full blocks + 1 token
    bad_hashes = {"repeats at index 1": [5, 5, 6],
                  "already cached under another parent": [9, ha[0], 7],
                  "must have 3 or 4 entries": [1, 2],
                  r"ints in \[0, 2\*\*64\)": [1, 2, -3],
                  "ints in": [1, 2.0, 3]}
    for message, hashes in bad_hashes.items():
        with pytest.raises(ValueError, match=message):
            prefill_request(worker, toks, block_hashes=hashes)
    assert _snapshot(worker.cache) == before and not worker.live_requests
    want = [3, 0, 255]
    for ok in (want, np.array(want, np.uint8), [np.int64(3), 0, np.int32(255)], tuple(want)):
        np.testing.assert_array_equal(as_token_ids(ok, 256), np.array(want, np.int64))


def test_failed_requests_leave_cache_and_lru_ages_unchanged(model, monkeypatch):
    worker = _small_worker(model, 2, 4)
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, 8), rng.integers(0, 256, 8)
    ha, hb = _fill(worker.cache, a, b)  # pool full; a is the LRU sequence
    before = _snapshot(worker.cache)
    with pytest.raises(OutOfBlocksError):  # hits a's 2 blocks, needs 5 more: only b evictable
        prefill_request(worker, np.concatenate([a, rng.integers(0, 256, 20)]))
    assert _snapshot(worker.cache) == before
    probe = copy.deepcopy(worker.cache)
    probe.allocate(0, 1)  # the failed hit did not refresh a: a is still the LRU sequence
    assert [(e.kind, e.block_hash) for e in probe.drain_events()[-1:]] == [("evict", ha[1])]
    # A failure after the allocation (which evicted a) undoes the eviction and the allocation.
    monkeypatch.setattr(worker, "sharded", lambda x: (_ for _ in ()).throw(RuntimeError("io")))
    with pytest.raises(RuntimeError, match="io"):
        prefill_request(worker, rng.integers(0, 256, 8))
    assert _snapshot(worker.cache) == before and not worker.live_requests
    worker.cache.allocate(0, 1)  # a was neither touched nor lost: it is still the LRU leaf
    assert [(e.kind, e.block_hash) for e in worker.cache.drain_events()[-1:]] == [
        ("evict", ha[1])]
    assert hb[1] in worker.cache


def test_release_request_rejects_double_and_foreign_release(model):
    worker = _small_worker(model, 3, 4)
    rng = np.random.default_rng(4)
    first = prefill_request(worker, rng.integers(0, 256, 3))  # only a partial block
    release_request(worker, first)
    second = prefill_request(worker, rng.integers(0, 256, 12))  # 3 full blocks, cached
    assert second.block_ids[0] == first.block_ids[0]  # the freed block was reused
    before = _snapshot(worker.cache)
    with pytest.raises(ValueError, match="not a live request"):
        release_request(worker, first)  # would free a block the tree owns
    other = _small_worker(model, 4, 4)
    with pytest.raises(ValueError, match="not a live request"):
        release_request(other, second)
    assert _snapshot(worker.cache) == before
    assert [worker.cache.refcount(h) for h in second.locked_hashes] == [1, 1, 1]
    release_request(worker, second)
    assert [worker.cache.refcount(h) for h in second.locked_hashes] == [0, 0, 0]
    assert not worker.live_requests
