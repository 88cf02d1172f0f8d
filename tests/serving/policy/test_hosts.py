"""Workers on hosts (issue 19): host ids on specs, layouts that never span hosts, no cross-host
merges, and KV copies priced at the scale-out bandwidth across hosts."""

from __future__ import annotations

import dataclasses

import pytest

from serving.policy.cache_manager import CacheManagerConfig, PrefixCacheManager
from serving.policy.composition import CompositionConfig, CompositionController
from serving.policy.composition_changes import candidate_changes
from serving.policy.controller import ControllerConfig, ReconfigurationController
from serving.policy.fetch_router import FetchingVertumnusRouter
from serving.policy.prefix_trie import GlobalPrefixTrie
from serving.policy.reconfiguration import Reconfigurations
from serving.policy.replication import SCALEOUT_GB_PER_S, copy_seconds, link_gb_per_s
from serving.policy.request import Request, chain_block_hashes
from serving.policy.router import LeastWorkRouter
from serving.policy.scheduler import Scheduler
from serving.policy.worker import (WorkerSpec, WorkerState, are_buddies, assign_hosts,
                                   host_degree_cap, layout_workers, merge_buddies, split_halves)
from tests.serving.policy.scheduler_fixtures import Backend, MsCost

BS = 512


def test_spec_host_is_validated_and_kept_by_split_and_merge():
    assert WorkerSpec(0, 2, 0, 10, 100).host == 0
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="host must be an integer >= 0"):
            WorkerSpec(0, 2, 0, 10, 100, host=bad)
    spec = WorkerSpec(3, 4, 12, 40, 100, host=1)
    a, b = split_halves(spec, (7, 8), lambda c: 50 * c)
    assert (a.host, b.host, a.first_device, b.first_device) == (1, 1, 12, 14)
    assert merge_buddies(a, b, 9, lambda c: 50 * c) == WorkerSpec(9, 4, 12, 40, 200, host=1)
    # The same devices on different hosts are never buddies, and never merged.
    c = WorkerSpec(10, 2, 14, 20, 100, host=2)
    assert are_buddies(a, b) and not are_buddies(a, c)
    with pytest.raises(ValueError, match="different hosts"):
        merge_buddies(a, c, 11, lambda c: 100)
    # A split keeps its host (the reconfiguration check).
    wrong = [WorkerSpec(7, 2, 12, 20, 100, host=1), WorkerSpec(8, 2, 14, 20, 100, host=0)]
    with pytest.raises(ValueError, match="keeps its host"):
        Reconfigurations(9).check("split", [3], wrong, {3: WorkerState(spec)})


def test_layout_on_hosts_of_eight_never_spans():
    specs = layout_workers([8, 8, 4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1], 10, 100,
                           devices_per_host=8)
    assert sorted({s.host for s in specs}) == [0, 1, 2, 3, 4]  # the paper's 5 x 8
    assert all(s.first_device // 8 == s.host == s.devices[-1] // 8 for s in specs)
    assert [s.host for s in layout_workers([4, 4], 10, 100)] == [0, 0]  # one host by default
    with pytest.raises(ValueError, match=r"worker 0 \(cp_degree=16, devices 0..15\) would span "
                                          r"hosts 0..1"):
        layout_workers([16], 10, 100, devices_per_host=8)
    with pytest.raises(ValueError, match="worker 1 .*would span hosts 0..1 of 6 devices"):
        layout_workers([4, 4, 4], 10, 100, devices_per_host=6)  # misaligned with the hosts
    spanning = layout_workers([16], 10, 100, devices_per_host=8, allow_span=True)
    assert spanning[0].host == 0
    with pytest.raises(ValueError, match="devices_per_host must be an integer >= 1"):
        assign_hosts(specs, 0)
    assert host_degree_cap(specs) == 8 and host_degree_cap([]) == 0
    assert host_degree_cap(layout_workers([8, 8, 8, 8, 8], 10, 100)) == 32  # one host of 40


def _pool(degrees, per_host):
    s = Scheduler(layout_workers(degrees, 100, 1 << 20, devices_per_host=per_host), MsCost(),
                  LeastWorkRouter(), Backend())
    return s


def test_threshold_controller_never_merges_across_hosts():
    ctl = ReconfigurationController(ControllerConfig(max_degree=16), 16, lambda c: 1 << 20)
    s = _pool([8, 8], 8)  # aligned halves of devices 0-15, but on two hosts
    ctl.attach(s)
    assert are_buddies(s.workers[0].spec, dataclasses.replace(s.workers[1].spec, host=0))
    assert ctl._merge(s, 0.0) is None
    s = _pool([4, 4, 4, 4], 8)  # buddies inside each host merge
    ctl = ReconfigurationController(ControllerConfig(max_degree=16), 16, lambda c: 1 << 20)
    ctl.attach(s)
    kind, old, [new] = ctl._merge(s, 0.0)
    assert (kind, old, new.cp_degree, new.host) == ("merge", [0, 1], 8, 0)


def test_composition_controller_caps_degrees_at_a_host():
    s = _pool([4, 4, 4, 4], 8)
    ctl = CompositionController(CompositionConfig(max_degree=16), lambda c: 1 << 20)
    changes = list(candidate_changes(list(s.workers.values()), 0.0, {1, 2, 4, 8, 16}, ctl.config,
                                     0, ctl.max_input_len))
    merges = [(sorted(w.worker_id for w in olds), news) for olds, news in changes
              if len(olds) == 2]
    assert merges and all(s.workers[a].spec.host == s.workers[b].spec.host
                          for (a, b), _ in merges)
    s2 = _pool([8, 8], 8)
    assert not [o for o, n in candidate_changes(list(s2.workers.values()), 0.0, {4, 8, 16},
                                                ctl.config, 0, ctl.max_input_len)
                if len(o) == 2]


def test_copy_seconds_within_and_across_hosts_by_hand():
    assert SCALEOUT_GB_PER_S == 25.0
    assert link_gb_per_s(0, 0, 100.0) == 100.0 and link_gb_per_s(0, 1, 100.0) == 25.0
    # 10 blocks x 512 tokens x 98,304 B/token = 503.3 MB: 5.03 ms on NVLink, 20.1 ms across.
    intra = copy_seconds(10, BS, 98_304, link_gb_per_s(2, 2, 100.0, 25.0))
    cross = copy_seconds(10, BS, 98_304, link_gb_per_s(2, 3, 100.0, 25.0))
    assert intra == pytest.approx(10 * 512 * 98_304 / 100e9)
    assert cross == pytest.approx(10 * 512 * 98_304 / 25e9) == pytest.approx(4 * intra)
    assert copy_seconds(10, BS, 98_304, link_gb_per_s(0, 1, 100.0, 0.0)) == 0.0  # 0 = free


class FakeScheduler:
    def __init__(self):
        from serving.policy.prefix_index import PrefixIndex
        self.cost_model, self.prefix_index, self.dispatch_hooks = MsCost(), PrefixIndex(), []
        self.copies = self

    def fetch_for_request(self, *a):
        return None


def test_fetch_router_prices_a_cross_host_copy_at_the_scaleout_bandwidth():
    # CP-4 workers: 0 on host 0 caches 12 blocks of q; 1 and 2 on host 1, 1 caches 8.
    L = 1 << 20
    workers = [WorkerState(WorkerSpec(0, 4, 0, 4000, L, host=0)),
               WorkerState(WorkerSpec(1, 4, 8, 4000, L, host=1)),
               WorkerState(WorkerSpec(2, 4, 12, 4000, L, host=1))]
    q = Request("q", 0.0, 16 * BS, 1, chain_block_hashes(range(16)), BS)
    sched = FakeScheduler()
    sched.prefix_index.insert(0, q.block_hashes[:12])
    sched.prefix_index.insert(1, q.block_hashes[:8])

    def plans(scaleout):
        r = FetchingVertumnusRouter(kv_bytes_per_token=100_000, transfer_gb_per_s=1.0,
                                    scaleout_gb_per_s=scaleout)
        r.bind(sched)
        return r.plans(q, workers, [12, 8, 0], 0.0)

    # A block is 51.2 MB: 51.2 ms in a host at 1 GB/s, 204.8 ms across at 0.25 GB/s.
    # Worker 2 (host 1, nothing cached): local 8.192 / 4 = 2.048 s; from worker 0 (12 blocks,
    # across): 12 x 0.2048 + 2.048 / 4 = 2.9696; from worker 1 (8 blocks, same host):
    # 8 x 0.0512 + 4.096 / 4 = 1.4336: the shorter prefix on its own host wins.
    # Costs: S = 0.512 (w0), 1.024 (w1: 4 x 0.2048 + 0.512 = 1.3312 across does not pay),
    # 1.4336 (w2); cheapest C*S = 2.048; w2: 1.4336 + 4 x 1.4336 - 2.048 = 5.12.
    p = plans(0.25)
    assert [x[1:] for x in p] == [(0, -1, 0), (0, -1, 0), (8, 1, 8)]
    assert p[2][0] == pytest.approx(5.12, abs=1e-9)
    # At 1 GB/s across too, the longest prefix pays: w2 12 x 0.0512 + 0.512 = 1.1264 from
    # worker 0, and w1 fetches its 4 missing blocks: 4 x 0.0512 + 0.512 = 0.7168 < 1.024.
    p = plans(1.0)
    assert [x[1:] for x in p] == [(0, -1, 0), (4, 0, 12), (12, 0, 12)]
    assert p[2][0] == pytest.approx(1.1264 + 4 * 1.1264 - 2.048, abs=1e-9)


def test_fetch_for_request_and_cache_manager_prefer_a_same_host_source():
    b = Backend()
    specs = layout_workers([4, 4, 4, 4], 1000, 1 << 20, devices_per_host=8)  # hosts 0,0,1,1
    s = Scheduler(specs, MsCost(), LeastWorkRouter(), b, prefix_index=GlobalPrefixTrie())
    q = Request("q", 0.0, 16 * BS, 1, chain_block_hashes(range(16)), BS)
    s.prefix_index.insert(0, q.block_hashes[:10])  # host 0
    s.prefix_index.insert(2, q.block_hashes[:10])  # host 1
    rep = s.copies.fetch_for_request(q, 3, 16, 0.0)  # destination on host 1
    assert (rep.src, rep.dst) == (2, 3)
    rep = s.copies.fetch_for_request(q, 1, 16, 0.0)  # destination on host 0
    assert (rep.src, rep.dst) == (0, 1)
    # The cache manager: intra-degree replica of a hot prefix held on worker 0 (host 0) only.
    b2 = Backend()
    s2 = Scheduler(specs, MsCost(), LeastWorkRouter(), b2, prefix_index=GlobalPrefixTrie())
    chain = q.block_hashes[:12]
    s2.prefix_index.insert(0, chain)
    for _ in range(40):
        s2.prefix_index.record(q, 4, 12, 12)
    s2.workers[1].queued_seconds = 5.0  # the same-host destination is the busier one
    mgr = PrefixCacheManager(CacheManagerConfig(intra_high=4, max_actions=1))
    assert mgr.scan(s2, 1.0) == 1
    [rep] = b2.copies
    assert (rep.src, rep.dst) == (0, 1)  # the shorter copy first, then the load
    with pytest.raises(ValueError, match="transfer_gb_per_s"):
        PrefixCacheManager(scaleout_gb_per_s=-1.0)
