"""The prefix-cache manager in the simulator: copies happen, reach the index only when done,
and the index agrees with what every worker's cache really holds."""

from __future__ import annotations

import numpy as np
import pytest

from eval.sim.simulator import SimConfig, simulate
from serving.policy.cache_manager import CacheManagerConfig, PrefixCacheManager
from serving.policy.cost_router import VertumnusRouter
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.request import Request, chain_block_hashes, num_blocks
from serving.policy.worker import layout_workers


class Cost:
    def predict(self, c, n, h):
        return 0.01 + 2e-5 * (n - h) / c + 1e-10 * (n * n - h * h) / c

    __call__ = predict


def hot_prefix_workload(n=600, seed=0):
    """Requests sharing one of 3 long documents (16K tokens) plus a private question."""
    rng = np.random.default_rng(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.exponential(0.05)
        doc = int(rng.integers(0, 3))
        length = 16_384 + int(rng.integers(100, 900))
        ids = [1000 * doc + k for k in range(32)] + [10**6 + i * 10 + k
                                                     for k in range(num_blocks(length, 512) - 32)]
        reqs.append(Request(i, t, length, 1, chain_block_hashes(ids), 512))
    return reqs


def run(manager):
    reqs = hot_prefix_workload()
    workers = layout_workers([4, 2, 2, 1, 1], kv_blocks_per_device=200, max_input_len=64_000)
    handle = []
    setup = [handle.append] + ([manager.attach] if manager else [])
    cost = Cost()
    records = simulate(reqs, workers, cost, VertumnusRouter(), cost,
                       SimConfig(kv_bytes_per_token=100_000, tick_interval=0.5), setup=setup,
                       prefix_index=GlobalPrefixTrie())
    return records, handle[0]


def test_manager_replicates_and_index_matches_caches():
    manager = PrefixCacheManager(CacheManagerConfig(scan_interval_s=1.0, min_missed_tokens=1024,
                                                    intra_high=4.0))
    records, sched = run(manager)
    assert len(records) == 600 and all(r.ok for r in records)
    assert sched.copies.log, "no copy was made"
    kinds = {a["kind"] for a in manager.actions}
    assert "inter-degree" in kinds or "intra-degree" in kinds
    for log in sched.copies.log:
        assert log["finished"] > log["started"]  # copies take time (100 GB/s, 51 MB blocks)
    # Every block the index says a worker holds is in that worker's cache, and vice versa.
    caches = sched.backend.caches
    for wid in sched.workers:
        held = {h for h, _ in caches[wid].blocks()}
        assert sched.prefix_index.num_blocks(wid) == len(held)
        for h in held:
            assert wid in sched.prefix_index.holders(h)
    # The trie's per-request accounting is consistent with the records.
    assert sched.prefix_index.reused_tokens <= sched.prefix_index.global_tokens


def test_manager_needs_the_trie():
    from serving.policy.router import LeastWorkRouter
    from serving.policy.scheduler import Scheduler

    class B:
        def start_prefill(self, *a):
            pass

    s = Scheduler(layout_workers([1], 4, 100), Cost(), LeastWorkRouter(), B())
    with pytest.raises(ValueError, match="GlobalPrefixTrie"):
        PrefixCacheManager().attach(s)
