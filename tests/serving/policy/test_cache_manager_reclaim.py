"""Reclamation under the live working set (`serving.policy.cache_manager`, module doc): a cold
replica is freed only on a holder whose live set is at least its KV capacity."""

from __future__ import annotations

from serving.policy.cache_manager import CacheManagerConfig, PrefixCacheManager
from serving.policy.cost_router import VertumnusRouter
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.request import chain_block_hashes
from serving.policy.scheduler import Scheduler
from serving.policy.worker import layout_workers
from tests.serving.policy.scheduler_fixtures import DOC, Backend, Cost

CHAIN = DOC.block_hashes[:32]
OTHER = chain_block_hashes(range(1000, 1010))  # another context, 10 blocks


def cold_pair(kv_blocks_per_device: int, live_horizon_s: float | None = 60.0):
    """Two CP-2 workers (ids 0, 1) both holding CHAIN, asked for 0.1 times per replica pair
    per scan (below `reclaim_low` 0.5); worker 1 the busier."""
    b = Backend()
    router = VertumnusRouter(cost_model=Cost(), live_horizon_s=live_horizon_s)
    s = Scheduler(layout_workers([2, 2], kv_blocks_per_device, 100_000), Cost(), router, b,
                  prefix_index=GlobalPrefixTrie())
    for w in (0, 1):
        s.prefix_index.insert(w, CHAIN)
    s.prefix_index.record(DOC, cp_degree=2, global_blocks=32, reused_blocks=32)
    s.prefix_index.decay(0.1, floor=0.01)
    s.workers[1].queued_seconds = 3.0
    mgr = PrefixCacheManager(CacheManagerConfig(intra_high=8.0, reclaim_low=0.5))
    return s, b, router, mgr


def test_without_live_sets_the_papers_rule_frees_the_busier_holder():
    s, b, _, mgr = cold_pair(100, live_horizon_s=None)
    assert mgr.scan(s, 1.0) == 1
    assert b.reclaims == [(1, tuple(CHAIN))]


def test_no_reclaim_while_every_holders_live_set_fits():
    s, b, router, mgr = cold_pair(100)  # KV capacity 200 blocks a worker
    for w in (0, 1):
        router.live.touch(w, CHAIN, 0.5)  # 32 live blocks each
    assert mgr.scan(s, 1.0) == 0
    assert b.reclaims == [] and not s.copies.reclaims
    assert s.prefix_index.replica_count(CHAIN[-1], 2) == 2


def test_the_holder_whose_live_set_exceeds_its_capacity_gives_its_replica_up():
    s, b, router, mgr = cold_pair(20)  # KV capacity 40 blocks a worker
    router.live.touch(0, CHAIN, 0.5)
    router.live.touch(0, OTHER, 0.6)  # worker 0: 42 live blocks >= 40
    router.live.touch(1, CHAIN, 0.5)  # worker 1: 32 < 40, though the busier
    assert router.live.size(0, 1.0) == 42 and router.live.size(1, 1.0) == 32
    assert mgr.scan(s, 1.0) == 1
    assert b.reclaims == [(0, tuple(CHAIN))]
    assert mgr.actions[-1]["worker"] == 0


def test_once_the_horizon_has_passed_nothing_is_live_and_nothing_is_freed():
    s, b, router, mgr = cold_pair(20)
    router.live.touch(0, CHAIN, 0.5)
    router.live.touch(0, OTHER, 0.6)
    assert mgr.scan(s, 61.0) == 0  # every placement is older than the 60 s horizon
    assert router.live.size(0, 61.0) == 0 and b.reclaims == []


def test_a_router_whose_live_is_no_live_set_keeps_the_papers_rule():
    # A plug-in router may have its own `live` attribute: only a `LiveWorkingSet` is read.
    s, b, router, mgr = cold_pair(20)
    router.live = {0, 1}
    assert mgr.scan(s, 1.0) == 1
    assert b.reclaims == [(1, tuple(CHAIN))]  # the busier holder, as without live sets
