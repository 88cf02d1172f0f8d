"""Baseline routers: hand-computed decisions for each rule, tie rotation, argument checks."""

from __future__ import annotations

import pytest

from serving.baselines import (DynamoKvRouter, MooncakeConductorRouter, SglangCacheAwareRouter,
                               StaticThresholdRouter, VllmPrefixAwareRouter)
from serving.baselines.common import RoutedPrefixTrie, argmin_rotating
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import WorkerState, layout_workers

BS = 512


class LinearCost:
    """predict = (L - h) * 1 ms / C: easy to compute by hand."""

    def predict(self, cp_degree: int, input_len: int, cached_len: int) -> float:
        return (input_len - cached_len) * 1e-3 / cp_degree


def req(ids, rid=0, input_len=None) -> Request:
    """A request whose i-th block has content id ids[i] (full blocks unless input_len given)."""
    n = input_len if input_len is not None else len(ids) * BS
    return Request(rid, 0.0, n, 1, chain_block_hashes(ids), BS)


def pool(degrees, kv_blocks_per_device=1000) -> list[WorkerState]:
    return [WorkerState(s) for s in layout_workers(degrees, kv_blocks_per_device, 1 << 20)]


def load(worker: WorkerState, requests: int) -> None:
    """Gives `worker` that many outstanding (queued) requests."""
    worker.queue.extend(object() for _ in range(requests))


def fresh(i: int) -> Request:
    return req([10_000 + 10 * i + k for k in range(4)], rid=i)


# ------------------------------------------------------------------ shared helpers
def test_argmin_rotating_breaks_ties_from_the_start_index():
    assert argmin_rotating([3, 1, 1, 2], 0) == 1
    assert argmin_rotating([3, 1, 1, 2], 2) == 2
    assert argmin_rotating([3, 1, 1, 2], 3) == 1   # scan 3, 0, 1: first minimum is index 1
    assert [argmin_rotating([5, 5, 5], s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert argmin_rotating([(1, -2), (1, -3), (0, 9)], 0) == 2
    with pytest.raises(ValueError, match="non-empty"):
        argmin_rotating([], 0)


def test_routed_trie_evicts_leaves_first_within_capacity():
    trie = RoutedPrefixTrie(capacity=lambda w: 4)
    a = chain_block_hashes(range(10))
    trie.insert(0, a)
    assert trie.size(0) == 4
    assert trie.match(a, [0, 1]) == [4, 0]           # the 4 leading blocks (parents) survive
    b = a[:2] + chain_block_hashes([77, 78], parent=a[1])
    trie.insert(0, b)                                # touches a0, a1; evicts a3, a2 (oldest)
    assert trie.size(0) == 4
    assert trie.match(a, [0]) == [2] and trie.match(b, [0]) == [4]
    unbounded = RoutedPrefixTrie()
    unbounded.insert(3, a)
    assert unbounded.size(3) == 10 and unbounded.match(a, [3]) == [10]


ROUTERS = {
    "static-threshold": lambda: StaticThresholdRouter(cost_model=LinearCost()),
    "vllm": VllmPrefixAwareRouter,
    "sglang": SglangCacheAwareRouter,
    "dynamo": DynamoKvRouter,
    "mooncake": lambda: MooncakeConductorRouter(100_000, cost_model=LinearCost()),
}


@pytest.mark.parametrize("make", ROUTERS.values(), ids=ROUTERS.keys())
def test_idle_pool_ties_rotate_over_every_worker(make):
    router = make()
    workers = pool([4, 4, 4, 4])
    picks = [router.choose(fresh(i), workers, [0] * 4, 0.0) for i in range(8)]
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]


# ------------------------------------------------------------------ static threshold (FlexLB)
def test_static_threshold_routes_by_length_with_fallback():
    workers = pool([4, 4, 2, 2, 2, 2])               # ids 0, 1: CP-4; ids 2-5: CP-2
    r = StaticThresholdRouter(cost_model=LinearCost())
    short = req(range(2), input_len=1000)
    # 1000 tokens: short group although a CP-4 would be faster (1000 ms/4 < 1000 ms/2).
    assert r.choose(short, workers, [0] * 6, 0.0) == 2
    long8192 = req(range(16))                          # exactly 8192 tokens: long
    workers[0].queued_seconds = 5.0                    # Q: 5 + 2.048 > 0 + 2.048 on worker 1
    assert r.choose(long8192, workers, [0] * 6, 0.0) == 1
    assert r.group(req(range(16), input_len=8191), workers) == [2, 3, 4, 5]
    assert r.group(long8192, workers) == [0, 1]
    # No eligible worker in the request's group: the other group.
    forced = StaticThresholdRouter(long_degree=4, cost_model=LinearCost())
    assert forced.group(long8192, workers[2:]) == [0, 1, 2, 3]
    assert forced.group(short, workers[:2]) == [0, 1]


def test_static_threshold_is_cache_aware_inside_the_group():
    workers = pool([4, 2, 2])
    r = StaticThresholdRouter(cost_model=LinearCost())
    prompt = req(range(10), input_len=5000)           # short
    workers[1].queued_seconds = 0.5
    # worker 1 holds 9 blocks: 0.5 + (5000 - 4608) ms / 2 = 0.696 s; worker 2: 2.5 s.
    assert r.choose(prompt, workers, [0, 9, 0], 0.0) == 1
    workers[1].queued_seconds = 2.4                   # 2.596 s > 2.5 s
    assert r.choose(prompt, workers, [0, 9, 0], 0.0) == 2


# ------------------------------------------------------------------ vLLM production-stack
def test_vllm_prefixaware_follows_longest_routed_prefix_blind_to_load():
    workers = pool([4, 4, 4, 4])
    r = VllmPrefixAwareRouter()
    assert r.choose(req([1, 2, 3]), workers, [0] * 4, 0.0) == 0
    workers[0].queued_seconds = 100.0
    # Shares 2 routed blocks with worker 0; the KV-event matches (worker 3) are not used.
    assert r.choose(req([1, 2, 9]), workers, [0, 0, 0, 3], 0.0) == 0
    # Nothing routed matches: round robin over all (third call starts at worker 2).
    assert r.choose(req([5, 6]), workers, [0] * 4, 0.0) == 2


def test_vllm_prefixaware_spreads_ties_over_the_longest_match_set_only():
    workers = pool([4, 4, 4, 4])
    r = VllmPrefixAwareRouter()
    assert r.choose(req([1, 2]), workers[:1], [0], 0.0) == 0      # worker 0 gets [1, 2]
    assert r.choose(req([1, 2]), workers[1:2], [0], 0.0) == 0     # worker 1 gets [1, 2]
    picks = {workers[r.choose(req([1, 2, 50 + i]), workers, [0] * 4, 0.0)].worker_id
             for i in range(8)}
    assert picks == {0, 1}


# ------------------------------------------------------------------ SGLang cache_aware
def test_sglang_imbalance_goes_to_least_loaded_else_cache():
    workers = pool([4, 4, 4, 4])
    r = SglangCacheAwareRouter()
    prompt = req(range(10))
    assert r.choose(prompt, workers[:1], [0], 0.0) == 0           # worker 0's tree: 10 blocks
    load(workers[0], 70)
    load(workers[2], 5)
    load(workers[3], 3)
    # 70 - 0 > 64 and 70 > 1.5 * 0: least loaded (worker 1) despite worker 0's full match.
    assert r.choose(prompt, workers, [0] * 4, 0.0) == 1
    assert not r.imbalanced([64, 0, 0, 0])                         # 64 is not > 64
    assert not r.imbalanced([200, 135, 150, 150])                  # 200 <= 1.5 * 135
    assert r.imbalanced([200, 133, 150, 150])


def test_sglang_cache_threshold_and_smallest_tree():
    workers = pool([4, 4, 4, 4])
    r = SglangCacheAwareRouter()
    assert r.choose(req(range(10)), workers[2:3], [0], 0.0) == 0   # worker 2's tree: 10 blocks
    # 4 of 10 blocks match on worker 2: rate 0.4 > 0.3, cache wins.
    hit = req([0, 1, 2, 3, 20, 21, 22, 23, 24, 25], rid=1)
    assert r.choose(hit, workers, [0] * 4, 0.0) == 2
    # 3 of 10 blocks: rate 0.3 is not > 0.3, so the smallest tree: workers 0, 1, 3 are empty
    # and this third call's scan starts at index 2, so worker 3 is the first empty one.
    miss = req([0, 1, 2, 30, 31, 32, 33, 34, 35, 36], rid=2)
    assert r.choose(miss, workers, [0] * 4, 0.0) == 3
    assert [r._trie.size(w) for w in range(4)] == [0, 0, 16, 10]


# ------------------------------------------------------------------ Dynamo KV router
def test_dynamo_logits_by_hand():
    a, b = pool([4, 4])
    r = DynamoKvRouter()
    p = req([1, 2])                                   # 1024 tokens, 1 block cached on a
    assert r.choose(p, [a], [1], 0.0) == 0            # a: 512 active prefill tokens, {h1, h2}
    load(a, 1)
    q = req([1, 2, 3, 4], rid=1)                      # 2048 tokens; a caches 2 blocks
    # a: (512 + 2048 - 1024) / 512 + (2 active + 2 new blocks) = 3 + 4 = 7
    # b: 2048 / 512 + (0 + 4) = 8
    assert r.logits(q, [a, b], [2, 0], 0.0) == [7.0, 8.0]
    assert DynamoKvRouter(overlap_score_weight=0.0).logits(q, [a, b], [2, 0], 0.0) == [4.0, 4.0]
    assert r.choose(q, [a, b], [2, 0], 0.0) == 0      # a: +1024 tokens, blocks {h1..h4}
    load(a, 1)
    s = req([7, 8, 9, 10], rid=2)
    # a: (512 + 1024 + 2048) / 512 + (4 active + 4 new) = 7 + 8 = 15; b: 4 + 4 = 8
    assert r.logits(s, [a, b], [0, 0], 0.0) == [15.0, 8.0]
    a.queue.clear()                                   # both finished: forgotten
    assert r.logits(q, [a, b], [2, 0], 0.0) == [6.0, 8.0]


# ------------------------------------------------------------------ Mooncake Conductor
def test_mooncake_earliest_ttft_with_transfer_plan():
    a, b, c = pool([4, 4, 4])
    a.queued_seconds, c.queued_seconds = 2.0, 0.5
    r = MooncakeConductorRouter(kv_bytes_per_token=100_000, transfer_gb_per_s=1.0,
                                cost_model=LinearCost())
    q = req(range(16))                                # 8192 tokens; a: 12 blocks, c: 4
    # block copy: 512 * 1e5 B / 1e9 B/s = 51.2 ms. best prefix 12 blocks (6144 tokens):
    # a: 2 + (8192 - 6144) ms / 4 = 2.512 (it holds the best prefix)
    # b: min(2.048, 12 * 0.0512 + 0.512) = 1.1264 (copies 12 blocks)
    # c: 0.5 + min(1.536, 8 * 0.0512 + 0.512) = 1.4216 (copies 8 blocks)
    plans = r.plans(q, [a, b, c], [12, 0, 4], 0.0)
    assert [p[1] for p in plans] == [0, 12, 8]
    assert [p[0] for p in plans] == pytest.approx([2.512, 1.1264, 1.4216], abs=1e-12)
    assert r.choose(q, [a, b, c], [12, 0, 4], 0.0) == 1 and r.last_transfer_blocks == 12
    # Slow network: copying never pays; c is earliest with its local prefix (0.5 + 1.536).
    slow = MooncakeConductorRouter(100_000, transfer_gb_per_s=0.01, cost_model=LinearCost())
    assert slow.choose(q, [a, b, c], [12, 0, 4], 0.0) == 2 and slow.last_transfer_blocks == 0
    # Balancing threshold 4: c's ratio 12 / 4 = 3 < 4, no transfer considered for c.
    strict = MooncakeConductorRouter(100_000, 1.0, kvcache_balancing_threshold=4.0,
                                     cost_model=LinearCost())
    assert strict.plans(q, [a, b, c], [12, 0, 4], 0.0)[2] == pytest.approx((2.036, 0))


# ------------------------------------------------------------------ argument checks
def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="threshold_tokens"):
        StaticThresholdRouter(threshold_tokens=0)
    with pytest.raises(ValueError, match="cache_threshold"):
        SglangCacheAwareRouter(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        SglangCacheAwareRouter(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="max_tree_blocks"):
        SglangCacheAwareRouter(max_tree_blocks=0)
    with pytest.raises(ValueError, match="overlap_score_weight"):
        DynamoKvRouter(overlap_score_weight=-1)
    with pytest.raises(ValueError, match="transfer_gb_per_s"):
        MooncakeConductorRouter(1, transfer_gb_per_s=-1)
    with pytest.raises(ValueError, match="kvcache_balancing_threshold"):
        MooncakeConductorRouter(1, kvcache_balancing_threshold=0.5)
