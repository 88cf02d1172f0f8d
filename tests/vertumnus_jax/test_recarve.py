"""Split, merge and cross-degree replication of CP workers: weights by buffer pointer, KV by value.

Prompts are 200 tokens with 16-token blocks (12 full blocks); prompt B shares A's first 5
blocks. References are `full_prefill` (dense single-device) of the whole prompt. After every
change, prefill reusing a moved prefix must give the reference first token and logits, the
cache must hold block i on rank `i mod C`, and that rank's pool must hold the reference K/V.
All workers share one executables dict, so each (device set, C, bucket) compiles once.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh import ParamReplicas, buffer_pointers, worker_mesh
from vertumnus_jax.config import ModelConfig
from vertumnus_jax.model import full_prefill, init_model
from vertumnus_jax.prefill import prefill_request, release_request
from vertumnus_jax.prefix_cache import OutOfBlocksError, block_hashes
from vertumnus_jax.recarve import (
    merge_workers,
    reclaim_prefix,
    replicate_prefix,
    split_worker,
)
from vertumnus_jax.recarve_parts import split_worker_into
from vertumnus_jax.worker import Worker

BS, LEN, SHARED = 16, 200, 5
CFG = ModelConfig.tiny()
BLOCK_BYTES = 2 * CFG.num_layers * BS * CFG.num_kv_heads * CFG.head_dim * 4  # K+V, float32


@pytest.fixture(scope="module")
def env():
    model = init_model(CFG, seed=0)
    graphdef, state = nnx.split(model)
    replicas = ParamReplicas(state, jax.devices())
    rng = np.random.default_rng(7)
    a = rng.integers(0, CFG.vocab_size, LEN)
    b = np.concatenate([a[:SHARED * BS], rng.integers(0, CFG.vocab_size, LEN - SHARED * BS)])
    refs = {}
    for name, toks in (("a", a), ("b", b)):
        logits, k, v = full_prefill(model, toks)
        refs[name] = dict(tokens=toks, hashes=block_hashes(toks, BS),
                          logits=np.asarray(logits[-1]), k=np.asarray(k), v=np.asarray(v))
    return dict(graphdef=graphdef, replicas=replicas, refs=refs, exe={})


def _worker(env, first, cp, num_blocks):
    return Worker.from_replicas(worker_mesh(jax.devices(), first, cp), env["graphdef"],
                                env["replicas"], num_blocks=num_blocks, block_size=BS,
                                executables=env["exe"])


def _check_prefill(result, ref, cached_blocks):
    assert result.cached_blocks == cached_blocks
    assert result.first_token == int(np.argmax(ref["logits"]))
    np.testing.assert_allclose(result.logits, ref["logits"], atol=1e-5, rtol=0)


def _check_layout(worker, ref, n_blocks=None):
    """Block i of the chain is cached on rank i % C and that rank holds the reference K/V."""
    hashes = ref["hashes"][:n_blocks]
    nodes = worker.cache.state()["nodes"]
    for i, h in enumerate(hashes):
        parent, rank, _ = nodes[h]
        assert rank == i % worker.cp_degree and parent == (hashes[i - 1] if i else None)
    k, v = worker.pool.read_sequence([worker.cache.block_id(h) for h in hashes])
    np.testing.assert_allclose(k, ref["k"][:, :len(hashes) * BS], atol=1e-5, rtol=0)
    np.testing.assert_allclose(v, ref["v"][:, :len(hashes) * BS], atol=1e-5, rtol=0)


def _kv_pointers(worker):
    return {s.device.id: s.data.unsafe_buffer_pointer()
            for arr in (worker.pool.k,) for s in arr.addressable_shards}


def _restripe_moves(targets, holders):
    """Independent count of moved blocks: a block at depth i kept by a new worker lands on the
    worker's device `first + i % C`; it moves unless that device held a copy before."""
    moved = 0
    for first, c, chains in targets:
        kept = {(i, h) for ch in chains for i, h in enumerate(ch)}
        moved += sum((first + i % c) not in holders[h] for i, h in kept)
    return moved


def test_split_then_merge_moves_no_weights_and_keeps_prefixes(env):
    ra, rb = env["refs"]["a"], env["refs"]["b"]
    w = _worker(env, 0, 4, 16)
    release_request(w, prefill_request(w, ra["tokens"]))
    release_request(w, prefill_request(w, rb["tokens"]))
    before = prefill_request(w, ra["tokens"])  # reuses all 12 blocks
    _check_prefill(before, ra, 12)
    meshes = (worker_mesh(jax.devices(), 0, 2), worker_mesh(jax.devices(), 2, 2))
    state = w.cache.state()
    with pytest.raises(ValueError, match="1 live requests"):
        split_worker(w, meshes)
    assert w.cache.state() == state and w.retired is None
    release_request(w, before)
    weights, kv = buffer_pointers(w.params), _kv_pointers(w)
    holders = {h: {i % 4} for ref in (ra, rb) for i, h in enumerate(ref["hashes"])}

    # Split: prefix A goes to the upper half, B to the lower one (the shared 5 blocks to both).
    lower, upper, stats = split_worker(
        w, meshes, assign=lambda path: 1 if path[-1] == ra["hashes"][-1] else 0)
    assert w.retired == "split"
    with pytest.raises(RuntimeError, match="retired"):
        w.pool  # noqa: B018
    assert stats.weight_bytes_moved == 0 and stats.dropped_hashes == ()
    assert buffer_pointers(lower.params) == {d: weights[d] for d in (0, 1)}
    assert buffer_pointers(upper.params) == {d: weights[d] for d in (2, 3)}
    assert {**_kv_pointers(lower), **_kv_pointers(upper)} == kv  # pools re-wrapped in place
    want = _restripe_moves([(0, 2, [rb["hashes"]]), (2, 2, [ra["hashes"]])], holders)
    assert want == 12 and stats.kv_blocks_moved == want
    assert stats.kv_bytes_moved == want * BLOCK_BYTES
    assert stats.kv_blocks_in_place == 24 - want
    assert set(stats.cached_hashes[0]) == set(rb["hashes"]) == set(lower.cached_hashes())
    assert set(stats.cached_hashes[1]) == set(ra["hashes"]) == set(upper.cached_hashes())
    _check_layout(lower, rb)
    _check_layout(upper, ra)
    r = prefill_request(upper, ra["tokens"])
    _check_prefill(r, ra, 12)
    np.testing.assert_allclose(r.logits, before.logits, atol=1e-5, rtol=0)  # same as before
    release_request(upper, r)
    r = prefill_request(lower, rb["tokens"])
    _check_prefill(r, rb, 12)
    release_request(lower, r)
    assert len(upper.cache.match(rb["hashes"])) == SHARED  # the shared blocks are on both

    # Merge back: union of both caches, re-striped to i mod 4, nothing dropped.
    depth = {h: i for ref in (ra, rb) for i, h in enumerate(ref["hashes"])}
    holders = {h: {first + depth[h] % 2 for first, half in ((0, lower), (2, upper))
                   if h in half.cache} for h in depth}
    merged, mstats = merge_workers(upper, lower, worker_mesh(jax.devices(), 0, 4))
    assert lower.retired == upper.retired == "merge"
    assert mstats.weight_bytes_moved == 0 and buffer_pointers(merged.params) == weights
    assert _kv_pointers(merged) == kv
    want = _restripe_moves([(0, 4, [ra["hashes"], rb["hashes"]])], holders)
    assert want == 7 and mstats.kv_blocks_moved == want and mstats.dropped_hashes == ()
    assert set(mstats.cached_hashes[0]) == set(ra["hashes"]) | set(rb["hashes"])
    _check_layout(merged, ra)
    _check_layout(merged, rb)
    compiled = len(env["exe"])
    after = prefill_request(merged, ra["tokens"])  # same device set: executables reused
    _check_prefill(after, ra, 12)
    assert len(env["exe"]) == compiled
    np.testing.assert_allclose(after.logits, before.logits, atol=1e-6, rtol=0)
    release_request(merged, after)


def _fill(worker, rng, n_chains, length):
    """Caches `n_chains` random prompts of `length` full blocks (oldest first) with random K/V
    written to their blocks; returns [(hashes, k, v)]."""
    out = []
    shape = (CFG.num_layers, length * BS, CFG.num_kv_heads, CFG.head_dim)
    for _ in range(n_chains):
        hashes = block_hashes(rng.integers(0, CFG.vocab_size, length * BS), BS)
        ids = worker.cache.allocate(0, length)
        worker.cache.insert(hashes, ids)
        k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        worker.pool.write_sequence(ids, k, v)
        out.append((hashes, k, v))
    return out


def _check_data(worker, hashes, k, v):
    got_k, got_v = worker.pool.read_sequence([worker.cache.block_id(h) for h in hashes])
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    for i, h in enumerate(hashes):
        assert worker.cache.state()["nodes"][h][1] == i % worker.cp_degree


def test_merge_drops_least_recently_used_prefixes_that_do_not_fit(env):
    rng = np.random.default_rng(11)
    a, b = _worker(env, 6, 1, 4), _worker(env, 7, 1, 4)
    chains_a, chains_b = _fill(a, rng, 3, 1), _fill(b, rng, 3, 1)  # 3 depth-0 blocks each
    merged, stats = merge_workers(a, b, worker_mesh(jax.devices(), 6, 2))
    # Rank 0 of the merged worker can hold 4 of the 6 depth-0 blocks: the oldest of each go.
    assert set(stats.dropped_hashes) == {chains_a[0][0][0], chains_b[0][0][0]}
    assert stats.kv_blocks_moved == 2  # b's survivors move from device 7 to rank 0 (device 6)
    for hashes, k, v in chains_a[1:] + chains_b[1:]:
        _check_data(merged, hashes, k, v)
    assert len(merged.cache) == 4 and merged.cache.num_free(0) == 0


def test_split_policy_balances_or_follows_assign_and_drops_lru(env):
    rng = np.random.default_rng(12)
    devices = jax.devices()
    meshes = (worker_mesh(devices, 4, 1), worker_mesh(devices, 5, 1))
    w = _worker(env, 4, 2, 4)
    chains = _fill(w, rng, 4, 1)  # 4 depth-0 blocks: rank 0 (device 4) is full
    state = w.cache.state()
    with pytest.raises(ValueError, match="assign must return 0"):
        split_worker(w, meshes, assign=lambda path: 2)
    with pytest.raises(ValueError, match=r"meshes\[0\] must be"):
        split_worker(w, meshes[::-1])
    with pytest.raises(ValueError, match="must be a 1-D mesh with axis 'cp'"):
        split_worker(w, (worker_mesh(devices, 4, 1, axis="x"), meshes[1]))
    assert w.cache.state() == state and w.retired is None
    lower, upper, stats = split_worker(w, meshes, params=env["replicas"])  # balance occupancy
    assert len(lower.cache) == len(upper.cache) == 2 and stats.dropped_hashes == ()
    assert stats.weight_bytes_moved == 0
    assert stats.kv_blocks_moved == 2  # the upper half's blocks leave device 4
    for hashes, k, v in chains:
        _check_data(lower if hashes[0] in lower.cache else upper, hashes, k, v)

    # Two-block prefixes all assigned to the lower C=1 half: 8 blocks for 4 slots, so the two
    # least recently used prefixes are dropped whole.
    w = _worker(env, 4, 2, 4)
    chains = _fill(w, rng, 4, 2)
    # Freshly placed parameters (device_put copies) are counted as moved weight bytes.
    host = jax.tree.map(lambda x: np.array(x, copy=True), w.params)
    fresh = tuple(jax.device_put(host, NamedSharding(m, P())) for m in meshes)
    lower, upper, stats = split_worker(w, meshes, params=fresh, assign=lambda path: 0)
    assert stats.weight_bytes_moved == 2 * env["replicas"].nbytes_per_device
    assert buffer_pointers(lower.params) == buffer_pointers(fresh[0])
    assert set(stats.dropped_hashes) == set(chains[0][0]) | set(chains[1][0])
    assert len(upper.cache) == 0 and len(lower.cache) == 4
    for hashes, k, v in chains[2:]:
        _check_data(lower, hashes, k, v)


def test_split_into_parts_halves_within_one_call(env):
    # A CP-4 worker (devices 0-3, 4 blocks a rank) holding four 2-block prefixes, split into
    # [1, 1, 2] in one call: weights and KV pools re-wrapped in place, each kept prefix on one
    # part with its K/V and block i on the part's rank i mod C, and the in-place count equal
    # to an independent count from the blocks' devices before and after.
    rng = np.random.default_rng(13)
    devices = jax.devices()
    w = _worker(env, 0, 4, 4)
    chains = _fill(w, rng, 4, 2)
    weights, kv, state = buffer_pointers(w.params), _kv_pointers(w), w.cache.state()
    meshes = [worker_mesh(devices, 0, 1), worker_mesh(devices, 1, 1), worker_mesh(devices, 2, 2)]
    middle = jax.sharding.Mesh(np.array(devices[1:3]), ("cp",))
    for bad in ([meshes[0], middle, worker_mesh(devices, 3, 1)],  # [1, 2, 1]: unaligned
                meshes[:2], [worker_mesh(devices, 0, 4)], meshes[::-1],
                [meshes[0], meshes[1], worker_mesh(devices, 2, 2, axis="x")]):
        with pytest.raises(ValueError, match="parts repeated halving makes"):
            split_worker_into(w, bad)
    assert w.cache.state() == state and w.retired is None
    parts, stats = split_worker_into(w, meshes)
    assert w.retired == "split" and [p.cp_degree for p in parts] == [1, 1, 2]
    assert stats.weight_bytes_moved == 0
    for p, first in zip(parts, (0, 1, 2)):
        assert buffer_pointers(p.params) == {d: weights[d] for d in range(first,
                                                                          first + p.cp_degree)}
    assert {k: v for p in parts for k, v in _kv_pointers(p).items()} == kv
    kept, in_place = set(), 0
    for hashes, k, v in chains:
        holders = [(p, first) for p, first in zip(parts, (0, 1, 2)) if hashes[0] in p.cache]
        if not holders:
            continue
        [(p, first)] = holders
        _check_data(p, hashes, k, v)
        kept |= set(hashes)
        in_place += sum(first + i % p.cp_degree == i % 4 for i in range(len(hashes)))
    assert set(stats.dropped_hashes) == {h for ch in chains for h in ch[0]} - kept
    assert len(kept) >= 6 and stats.kv_blocks_in_place == in_place
    assert stats.kv_blocks_moved >= len(kept) - in_place
    assert [set(c) for c in stats.cached_hashes] == [set(p.cached_hashes()) for p in parts]


def test_bad_split_and_merge_change_nothing(env):
    devices = jax.devices()
    one, two = _worker(env, 0, 1, 4), _worker(env, 2, 2, 4)
    with pytest.raises(ValueError, match="CP degree 1"):
        split_worker(one, (worker_mesh(devices, 0, 1), worker_mesh(devices, 1, 1)))
    with pytest.raises(ValueError, match="differ in cp_degree"):
        merge_workers(one, two, worker_mesh(devices, 0, 4))
    with pytest.raises(ValueError, match="itself"):
        merge_workers(two, two, worker_mesh(devices, 0, 4))
    other = _worker(env, 1, 1, 4)
    with pytest.raises(ValueError, match=r"devices \[0, 1\] in that order"):
        merge_workers(other, one, worker_mesh(devices, 2, 2))
    upper_first = jax.sharding.Mesh(np.array([devices[1], devices[0]]), ("cp",))
    with pytest.raises(ValueError, match=r"devices \[0, 1\] in that order"):
        merge_workers(other, one, upper_first)  # lower device ids must come first
    with pytest.raises(ValueError, match="must hold ints"):
        replicate_prefix(one, other, ["123"])
    small = _worker(env, 1, 1, 2)
    with pytest.raises(ValueError, match="num_blocks"):
        merge_workers(one, small, worker_mesh(devices, 0, 2))
    held = two.cache.allocate(0, 1)
    meshes = (worker_mesh(devices, 2, 1), worker_mesh(devices, 3, 1))
    with pytest.raises(ValueError, match="outside its cache"):
        split_worker(two, meshes)
    two.cache.insert(block_hashes(np.arange(BS), BS), held)
    two.cache.lock(block_hashes(np.arange(BS), BS))
    with pytest.raises(ValueError, match="locked block"):
        split_worker(two, meshes)
    state = (one.cache.state(), two.cache.state())
    assert (one.retired, two.retired, other.retired) == (None, None, None)
    assert state == (one.cache.state(), two.cache.state())


def test_cross_degree_replication_and_reclaim(env):
    ra, rb = env["refs"]["a"], env["refs"]["b"]
    src = _worker(env, 0, 4, 16)
    release_request(src, prefill_request(src, ra["tokens"]))
    release_request(src, prefill_request(src, rb["tokens"]))
    dst2 = _worker(env, 4, 2, 8)
    # 4 -> 2: first a 5-block prefix, then the whole chain: only the 7 missing blocks move.
    r1 = replicate_prefix(src, dst2, ra["hashes"][:SHARED])
    assert r1.inserted == ra["hashes"][:SHARED] and r1.evicted == ()
    assert r1.kv_blocks_moved == SHARED and r1.kv_bytes_moved == SHARED * BLOCK_BYTES
    r2 = replicate_prefix(src, dst2, ra["hashes"])
    assert r2.inserted == ra["hashes"][SHARED:] and r2.kv_blocks_moved == 12 - SHARED
    assert dst2.cache.drain_events() == []  # reported through the results only
    _check_layout(dst2, ra)
    r = prefill_request(dst2, ra["tokens"])
    _check_prefill(r, ra, 12)
    release_request(dst2, r)

    # 2 -> 4 onto an empty worker; the prefill reuses the C=4 executables compiled above.
    dst4 = _worker(env, 0, 4, 16)
    r3 = replicate_prefix(dst2, dst4, ra["hashes"])
    assert r3.kv_blocks_moved == 12 and r3.inserted == ra["hashes"]
    _check_layout(dst4, ra)
    r = prefill_request(dst4, ra["tokens"])
    _check_prefill(r, ra, 12)
    release_request(dst4, r)

    # A destination that cannot hold the blocks: OutOfBlocksError, nothing changed.
    small = _worker(env, 6, 2, 4)
    before = small.cache.state()
    with pytest.raises(OutOfBlocksError):
        replicate_prefix(src, small, ra["hashes"])
    assert small.cache.state() == before and small.cache.events == []
    with pytest.raises(ValueError, match="share devices"):
        replicate_prefix(src, dst4, ra["hashes"])
    with pytest.raises(ValueError, match="src holds only 0"):
        replicate_prefix(small, dst2, rb["hashes"])

    # B's 7 own blocks need ranks 0/1: 3/4 blocks, 2/2 are free: LRU eviction of A's leaves
    # (depth 11 on rank 1, 10 on rank 0, 9 on rank 1); the shared 5 are locked meanwhile.
    r4 = replicate_prefix(src, dst2, rb["hashes"])
    assert r4.evicted == tuple(reversed(ra["hashes"][9:]))
    assert r4.inserted == rb["hashes"][SHARED:] and r4.kv_blocks_moved == 12 - SHARED
    _check_layout(dst2, rb)
    # Reclaim: A's unshared tail goes (not the 5 blocks B shares), then all of B.
    assert reclaim_prefix(dst2, ra["hashes"]) == tuple(reversed(ra["hashes"][SHARED:9]))
    assert all(h in dst2.cache for h in rb["hashes"])
    dst2.cache.lock(rb["hashes"][:SHARED])
    assert reclaim_prefix(dst2, rb["hashes"]) == tuple(reversed(rb["hashes"][SHARED:]))
    dst2.cache.unlock(rb["hashes"][:SHARED])
    assert reclaim_prefix(dst2, rb["hashes"]) == tuple(reversed(rb["hashes"][:SHARED]))
    assert len(dst2.cache) == 0 and dst2.cache.events == []
