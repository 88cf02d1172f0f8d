"""The simulated pool on hosts (issue 19): hosts of `gpus_per_host` GPUs, no spanning worker,
cross-host copies at the scale-out bandwidth, and simulated host failures."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from eval.sim.backend import SimulatedBackend
from eval.sim.simulator import SimConfig, simulate
from serving.policy.cache_manager import CacheManagerConfig, PrefixCacheManager
from serving.policy.controller import ControllerConfig, ReconfigurationController
from serving.policy.cost_router import VertumnusRouter
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.replication import Replication
from serving.policy.request import Request, chain_block_hashes, num_blocks
from serving.policy.router import LeastWorkRouter
from serving.policy.worker import layout_workers


class LinearCost:
    """T = 20 ms + 50 us per new token / C (router and ground truth)."""

    def predict(self, cp_degree, input_len, cached_len):
        return 0.02 + 5e-5 * (input_len - cached_len) / cp_degree

    __call__ = predict


def workload(seed=0, n=1500, rate=40.0, phases=None):
    """`n` Poisson arrivals at `rate` (or, with `phases`, at each `(until_s, rate)` in turn)."""
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        if phases:
            rate = next((r for until, r in phases if t < until), phases[-1][1])
        t += rng.exponential(1 / rate)
        length = int(rng.integers(300, 12_000))
        ids = [int(rng.integers(0, 6))] + [10_000 * i + k for k in range(num_blocks(length, 512) - 1)]
        out.append(Request(i, t, length, 1, chain_block_hashes(ids), 512))
    return out


def no_worker_spans(sched, now):
    for w in sched.workers.values():
        s = w.spec
        assert s.first_device // 8 == s.host == s.devices[-1] // 8, s


def test_forty_gpus_on_five_hosts_never_span_hosts_while_reconfiguring():
    workers = layout_workers([8, 8, 4, 4, 2, 2, 2, 2] + [1] * 8, 60, 100_000)
    assert sum(w.cp_degree for w in workers) == 40
    ctl = ReconfigurationController(ControllerConfig(upper=0.5, lower=0.2, window_s=5, hold_s=2,
                                                     cooldown_s=3, max_degree=16),
                                    40, lambda c: 100_000)
    handle = []
    cost = LinearCost()
    reqs = workload(n=2500, phases=[(30, 5.0), (50, 120.0), (1e9, 5.0)])  # merges, splits
    records = simulate(reqs, workers, cost, VertumnusRouter(), cost,
                       SimConfig(tick_interval=0.5, gpus_per_host=8),
                       tick_hooks=[no_worker_spans], setup=[ctl.attach, handle.append],
                       prefix_index=GlobalPrefixTrie())
    [sched] = handle
    assert sorted({w.spec.host for w in sched.workers.values()}) == [0, 1, 2, 3, 4]
    assert sched.reconfig.finished["merge"] > 0 and sched.reconfig.finished["split"] > 0
    assert max(sched.composition) <= 8  # a merge of two 8s would span two hosts
    assert len(records) == 2500 and all(r.ok for r in records)
    with pytest.raises(ValueError, match="--gpus_per_host=8: worker 0 .*would span hosts"):
        simulate(workload(n=5), layout_workers([16, 8], 60, 100_000), cost, LeastWorkRouter(),
                 cost, SimConfig(gpus_per_host=8))


def test_a_copy_across_hosts_runs_at_the_scaleout_bandwidth():
    workers = layout_workers([4, 4, 4, 4], 100, 100_000, devices_per_host=8)  # hosts 0, 0, 1, 1
    calls = []
    cfg = SimConfig(kv_bytes_per_token=1000, replication_gb_per_s=100.0, scaleout_gb_per_s=10.0)
    b = SimulatedBackend(workers, LinearCost(), cfg, None, lambda t, fn: calls.append(t))
    chain = chain_block_hashes(range(10))
    b.replicate(Replication(0, 1, chain, 0, 512, 1.0, "intra-degree"), 1.0)
    b.replicate(Replication(0, 2, chain, 0, 512, 1.0, "intra-degree"), 1.0)
    # 10 blocks x 512 tokens x 1000 B = 5.12 MB: 51.2 us at 100 GB/s, 512 us at 10 GB/s.
    assert calls == pytest.approx([1.0 + 5.12e6 / 100e9, 1.0 + 5.12e6 / 10e9])
    with pytest.raises(ValueError, match="gpus_per_host must be an integer >= 0"):
        SimConfig(gpus_per_host=-8)
    with pytest.raises(ValueError, match="host_failures entries"):
        SimConfig(host_failures=((0, 5.0, 4.0),))


@pytest.mark.parametrize("with_cache_manager", [False, True])
def test_a_host_failure_reroutes_fails_once_and_the_host_comes_back(with_cache_manager):
    workers = layout_workers([4] * 10, 60, 100_000)
    cost = LinearCost()
    handle = []
    setup = [handle.append]
    if with_cache_manager:
        setup.append(PrefixCacheManager(CacheManagerConfig(min_missed_tokens=0, intra_high=2,
                                                           scan_interval_s=1.0)).attach)
    reqs = workload(seed=1, n=1200, rate=120.0)
    cfg = SimConfig(tick_interval=0.5, gpus_per_host=8, kv_bytes_per_token=20_000,
                    host_failures=((1, 3.0, 6.0), (3, 4.0, None)))
    records = simulate(reqs, workers, cost, VertumnusRouter(), cost, cfg, setup=setup,
                       prefix_index=GlobalPrefixTrie() if with_cache_manager else None)
    [sched] = handle
    count = collections.Counter(r.request.request_id for r in records)
    assert len(count) == 1200 and set(count.values()) == {1}  # exactly one record each
    lost = [e for e in sched.membership.log if e["kind"] == "lost"]
    assert [(e["hosts"], e["gpus"]) for e in lost] == [([1], 8), ([3], 8)]
    failed = [r for r in records if not r.ok]
    assert sum(e["failed_running"] + e["failed_unplaceable"] for e in lost) == len(failed)
    assert failed and all(r.error.startswith(("host 1 failed", "host 3 failed")) for r in failed)
    assert sum(e["rerouted"] for e in lost) > 0
    # host 1 is back as new workers (ids never reused); host 3 is not
    hosts = collections.Counter(w.spec.host for w in sched.workers.values())
    assert sorted(hosts) == [0, 1, 2, 4] and min(w for w in sched.workers
                                                 if sched.workers[w].spec.host == 1) >= 10
    late = [r for r in records if r.ok and r.start_time > 6.0]
    assert any(r.worker_id >= 10 for r in late)  # the new workers serve
    assert all(r.worker_id not in {6, 7} for r in records if r.ok and r.start_time > 4.0)
