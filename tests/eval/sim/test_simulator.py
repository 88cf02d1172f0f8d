"""The simulator with the scheduler core on hand-computed scenarios."""

from __future__ import annotations

import numpy as np
import pytest

from eval.metrics import summarize
from eval.sim.simulator import SimConfig, simulate
from serving.policy.request import Request, chain_block_hashes, num_blocks
from serving.policy.router import LeastWorkRouter
from serving.policy.worker import layout_workers


class LinearCost:
    """T = 0.1 s + 1 ms per new token, for both the router and the ground truth."""

    def predict(self, cp_degree, input_len, cached_len):
        return 0.1 + 1e-3 * (input_len - cached_len)

    __call__ = predict


def make_request(rid, t, length, ids, bs=512, slo=None):
    return Request(rid, t, length, 10, chain_block_hashes(ids), bs, slo)


def test_three_requests_on_two_workers_hand_computed():
    # r0 (t=0, 1000 tok) -> w0, runs [0, 1.1]. r1 (t=0.5, 2000 tok): Q(w0)=0.6, Q(w1)=0 -> w1,
    # runs [0.5, 2.6]. r2 (t=1.0, 1000 tok, first block shared with r0): Q(w0)=0.1 < Q(w1)=1.6
    # -> w0 after r0; its first block (512 tokens) hits: 0.1 + 0.488 = 0.588 s, runs [1.1, 1.688].
    reqs = [make_request("r0", 0.0, 1000, [1, 2]), make_request("r1", 0.5, 2000, [7, 8, 9, 10]),
            make_request("r2", 1.0, 1000, [1, 3])]
    workers = layout_workers([1, 1], kv_blocks_per_device=100, max_input_len=10_000)
    cost = LinearCost()
    cfg = SimConfig(kv_bytes_per_token=0, first_token_seconds=0.0, tick_interval=0.0)
    records = {r.request.request_id: r for r in simulate(reqs, workers, cost, LeastWorkRouter(), cost, cfg)}
    assert [records[k].worker_id for k in ("r0", "r1", "r2")] == [0, 1, 0]
    assert records["r0"].ttft == pytest.approx(1.1)
    assert records["r1"].ttft == pytest.approx(2.1)
    assert records["r2"].start_time == pytest.approx(1.1)
    assert records["r2"].cached_len == 512
    assert records["r2"].ttft == pytest.approx(1.688 - 1.0)
    m = summarize(list(records.values()))
    assert m["mean_ttft_ms"] == pytest.approx((1.1 + 2.1 + 0.688) / 3 * 1e3)
    assert m["prefix_hit_rate"] == pytest.approx(512 / 4000)


def test_an_error_the_scheduler_kept_fails_the_simulation():
    # a dispatch hook that raises on r1: the scheduler fails r1 and goes on (a service must),
    # and the simulation, whose results would no longer be the policy's, raises at its end
    reqs = [make_request(f"r{i}", 0.1 * i, 1000, [10 * i, 10 * i + 1]) for i in range(3)]
    workers = layout_workers([1], kv_blocks_per_device=100, max_input_len=10_000)
    cost = LinearCost()

    def setup(s):
        def hook(request, worker_id, now):
            if request.request_id == "r1":
                raise RuntimeError("dispatch hook bug")
        s.dispatch_hooks.append(hook)

    cfg = SimConfig(kv_bytes_per_token=0, first_token_seconds=0.0, tick_interval=0.0)
    with pytest.raises(RuntimeError, match=r"1 error\(s\) .*'request_id': 'r1'.*dispatch hook bug"):
        simulate(reqs, workers, cost, LeastWorkRouter(), cost, cfg, setup=[setup])


def test_transfer_and_first_token_added_to_ttft():
    cfg = SimConfig(kv_bytes_per_token=1000, kv_transfer_gb_per_s=1.0, first_token_seconds=0.05,
                    tick_interval=0.0)
    cost = LinearCost()
    [rec] = simulate([make_request("a", 2.0, 1000, [1, 2])], layout_workers([2], 10, 4096), cost,
                     LeastWorkRouter(), cost, cfg)
    # prefill 1.1 s, transfer 1000 tok * 1000 B / 1e9 B/s = 1 ms, first token 50 ms.
    assert rec.ttft == pytest.approx(1.1 + 1e-3 + 0.05)
    assert rec.finish_time == pytest.approx(3.1)


def test_every_request_ends_exactly_once_and_fifo_per_worker():
    rng = np.random.default_rng(7)
    n = 400
    times = np.sort(rng.uniform(0, 20, n))
    reqs = []
    for i, t in enumerate(times):
        length = int(rng.integers(100, 4000))
        shared = int(rng.integers(0, 4))  # one of 4 shared first blocks
        ids = [shared] + [10_000 + i * 100 + k for k in range(num_blocks(length, 512) - 1)]
        reqs.append(make_request(i, float(t), length, ids))
    cost = LinearCost()
    workers = layout_workers([4, 2, 1, 1], kv_blocks_per_device=8, max_input_len=3000)
    records = simulate(reqs, workers, cost, LeastWorkRouter(), cost, SimConfig(tick_interval=0.5))
    assert sorted(r.request.request_id for r in records) == list(range(n))
    too_long = {r.request_id for r in reqs if r.input_len > 3000}
    assert {r.request.request_id for r in records if not r.ok} == too_long
    assert all("max_input_len" in r.error for r in records if not r.ok)
    by_worker = {}
    for r in records:
        if r.ok:
            by_worker.setdefault(r.worker_id, []).append(r)
    for runs in by_worker.values():
        runs.sort(key=lambda r: r.start_time)
        for a, b in zip(runs, runs[1:]):
            assert b.start_time >= a.finish_time - 1e-12  # one prefill at a time
            assert a.finish_time - a.start_time == pytest.approx(
                0.1 + 1e-3 * (a.request.input_len - a.cached_len))


def test_unsorted_requests_rejected():
    cost = LinearCost()
    reqs = [make_request("a", 1.0, 10, [1]), make_request("b", 0.5, 10, [2])]
    with pytest.raises(ValueError, match="sorted by arrival_time"):
        simulate(reqs, layout_workers([1], 4, 100), cost, LeastWorkRouter(), cost)


def test_sharing_the_caches_with_the_index_changes_no_decision():
    """The simulator lets the prefix index read the workers' caches (`share_blocks`); with an
    index that keeps its own copy from the KV events every record must be the same."""
    from serving.policy.prefix_trie import GlobalPrefixTrie

    class CopyingTrie(GlobalPrefixTrie):
        share_blocks = None  # the simulator then keeps the index from the KV events

    rng = np.random.default_rng(3)
    reqs = []
    for i in range(300):  # 6 shared prefixes, random suffixes, random lengths
        n = int(rng.integers(600, 4000))
        ids = [int(rng.integers(6))] + rng.integers(10, 10_000, num_blocks(n, 512)).tolist()
        reqs.append(make_request(i, i * 0.05, n, ids[:num_blocks(n, 512)]))
    workers = layout_workers([1, 1, 2], kv_blocks_per_device=24, max_input_len=10_000)
    cost = LinearCost()
    cfg = SimConfig(kv_bytes_per_token=0, first_token_seconds=0.0, tick_interval=0.0)
    runs = []
    for index in (GlobalPrefixTrie(), CopyingTrie()):
        records = simulate(reqs, workers, cost, LeastWorkRouter(), cost, cfg, prefix_index=index)
        runs.append([(r.request.request_id, r.worker_id, r.start_time, r.cached_len,
                      r.global_cached_len) for r in records])
    assert runs[0] == runs[1]
    assert sum(r[3] for r in runs[0]) > 0  # prefixes were reused (small caches: evictions too)


def test_mooncake_conductor_transfer_is_copied_and_waited_for():
    """Hand-computed: the Conductor sends r2 to the idle worker with a 7-block copy of r0's
    prefix from the busy one; the simulator copies only those blocks and starts r2 when the
    copy is done, so TTFT = transfer + prefill of the uncached rest."""
    from serving.baselines import MooncakeConductorRouter

    kv_bytes, gbps = 1000, 1.0  # one block copy: 512 * 1000 B / 1e9 B/s = 0.512 ms
    reqs = [make_request("r0", 0.0, 4096, range(1, 9)),                 # w0, [0, 4.196]
            make_request("r1", 5.0, 10_000, [1] + list(range(100, 119))),  # w0 (1-block hit)
            make_request("r2", 6.0, 4096, list(range(1, 8)) + [50])]      # shares 7 with r0
    workers = layout_workers([1, 1], kv_blocks_per_device=100, max_input_len=20_000)
    cost = LinearCost()
    cfg = SimConfig(kv_bytes_per_token=kv_bytes, kv_transfer_gb_per_s=0.0,
                    replication_gb_per_s=gbps, first_token_seconds=0.0, tick_interval=0.0)
    logs = []
    for execute in (True, False):
        router = MooncakeConductorRouter(kv_bytes, gbps, cost_model=cost, execute_transfers=execute)
        records = {r.request.request_id: r for r in simulate(
            reqs, workers, cost, router, cost, cfg, setup=[logs.append])}
        assert [records[k].worker_id for k in ("r0", "r1", "r2")] == [0, 0, 1]
        assert records["r1"].start_time == pytest.approx(5.0)
        r2 = records["r2"]
        if execute:
            # w0: 8.588 s of r1 left + 0.612 s; w1: 7 * 0.512 ms + (0.1 + 0.512) s: copy.
            assert router.fetches.started == 1 and router.fetches.skipped == 0
            assert r2.cached_len == 7 * 512
            assert r2.ttft == pytest.approx(7 * 0.512e-3 + 0.612)
            [copy] = logs[-1].copies.log
            assert (copy["src"], copy["dst"], copy["blocks"], copy["reason"]) == (
                0, 1, 7, "request-transfer")
            assert copy["finished"] == pytest.approx(6.0 + 7 * 0.512e-3)
        else:  # the plan is only an estimate: r2 recomputes its whole prompt on worker 1
            assert router.fetches.started == 0 and not logs[-1].copies.log
            assert r2.cached_len == 0 and r2.ttft == pytest.approx(0.1 + 4.096)


def test_fetching_vertumnus_router_copies_and_waits():
    """The same scenario with the placement cost that may fetch (`FetchingVertumnusRouter`):
    r2 goes to the idle worker with the 7-block copy, TTFT = transfer + prefill of the rest."""
    from serving.policy.fetch_router import FetchingVertumnusRouter

    kv_bytes, gbps = 1000, 1.0
    reqs = [make_request("r0", 0.0, 4096, range(1, 9)),
            make_request("r1", 5.0, 10_000, [1] + list(range(100, 119))),
            make_request("r2", 6.0, 4096, list(range(1, 8)) + [50])]
    workers = layout_workers([1, 1], kv_blocks_per_device=100, max_input_len=20_000)
    cost = LinearCost()
    cfg = SimConfig(kv_bytes_per_token=kv_bytes, kv_transfer_gb_per_s=0.0,
                    replication_gb_per_s=gbps, first_token_seconds=0.0, tick_interval=0.0)
    router = FetchingVertumnusRouter(kv_bytes, gbps, cost_model=cost)
    scheds = []
    records = {r.request.request_id: r for r in simulate(
        reqs, workers, cost, router, cost, cfg, setup=[scheds.append])}
    assert [records[k].worker_id for k in ("r0", "r1", "r2")] == [0, 0, 1]
    assert records["r2"].cached_len == 7 * 512
    assert records["r2"].ttft == pytest.approx(7 * 0.512e-3 + 0.612)
    assert [(c["src"], c["dst"], c["blocks"], c["reason"]) for c in scheds[0].copies.log] == [
        (0, 1, 7, "request-transfer")]
    assert router.fetches.started == 1


@pytest.mark.parametrize("mode", ["merge", "busy"])
def test_a_rerouted_request_fetches_only_where_and_when_it_starts(mode):
    """B shares a prefix with worker 0 and is queued behind Z on worker 3, which starts a split:
    B is re-routed. Its fetch is made when it starts, on the worker it starts on: "merge" (the
    prefix's holders are merging too) leaves no source, so B runs cold at once on an idle
    worker; "busy": B waits behind Q1 on worker 4 until 0.825 s, then the 100-block copy
    (0.2 s), then 20 ms of prefill: TTFT = queue + transfer + prefill."""
    from serving.baselines import MooncakeConductorRouter
    from serving.policy.worker import WorkerSpec

    class Cost:  # 1 ms a new token; CP-2 1 % slower, so CP-1 workers win ties
        def predict(self, c, n, cached):
            return (n - cached) * 1e-3 * (1.01 if c == 2 else 1.0)

        __call__ = predict

    bs, shared = 4, list(range(1, 101))  # a 400-token prefix
    def r(rid, t, n, hashes):
        return Request(rid, t, n, 1, tuple(hashes), bs)

    workers = [WorkerSpec(0, 1, 0, 1000, 10**6), WorkerSpec(1, 1, 1, 1000, 10**6),
               WorkerSpec(2, 2, 2, 2000, 10**6), WorkerSpec(3, 2, 4, 2000, 10**6)]
    reqs = [r("A", 0.0, 404, shared + [500]), r("X", 0.41, 2000, shared + list(range(1000, 1400))),
            r("X2", 0.42, 2000, list(range(2000, 2500))), r("Z", 0.43, 300, range(3000, 3075)),
            r("B", 0.62, 420, shared + list(range(4000, 4005)))]
    if mode == "busy":
        reqs += [r("Q1", 0.705, 120, range(5000, 5030)), r("Q2", 0.706, 120, range(6000, 6030))]
    state = {"first": None, "second": False}

    def hook(s, now):  # split an idle CP-2 worker at 0.5 s; at 0.7 s (0.71) split Z's worker
        if state["first"] is None and now >= 0.5 - 1e-9:
            w = next(w for w, st in s.workers.items() if st.cp_degree == 2 and st.running is None)
            fd = s.workers[w].spec.first_device
            a, b = s.new_worker_ids(2)
            s.begin_reconfiguration("split", [w], [WorkerSpec(a, 1, fd, 1000, 10**6),
                                                   WorkerSpec(b, 1, fd + 1, 1000, 10**6)], now)
            state["first"] = a
        elif (state["first"] in s.workers and not state["second"]
              and now >= (0.71 if mode == "busy" else 0.7) - 1e-9):
            zw = next(w for w, st in s.workers.items()
                      if st.running is not None and st.running.request_id == "Z")
            if mode == "merge":  # also the copy source goes: no worker holds the prefix
                [m] = s.new_worker_ids(1)
                s.begin_reconfiguration("merge", [0, 1], [WorkerSpec(m, 2, 0, 2000, 10**6)], now)
            fd = s.workers[zw].spec.first_device
            c, d = s.new_worker_ids(2)
            s.begin_reconfiguration("split", [zw], [WorkerSpec(c, 1, fd, 1000, 10**6),
                                                    WorkerSpec(d, 1, fd + 1, 1000, 10**6)], now)
            state["second"] = True

    cfg = SimConfig(kv_bytes_per_token=1_000_000, kv_transfer_gb_per_s=0, first_token_seconds=0.0,
                    tick_interval=0.01, replication_gb_per_s=2.0, recarve_seconds=0.2)
    scheds = []
    records = simulate(reqs, workers, Cost(), MooncakeConductorRouter(1_000_000, 2.0), Cost(),
                       cfg, tick_hooks=[hook], setup=[scheds.append])
    assert sorted(x.request.request_id for x in records) == sorted(x.request_id for x in reqs)
    b = next(x for x in records if x.request.request_id == "B")
    copies = [(c["dst"], c["started"], c["finished"]) for c in scheds[0].copies.log]
    if mode == "merge":
        # Re-routed at 0.70 s to an idle worker, no copy possible: cold 420 ms prefill at once.
        assert copies == [] and b.cached_len == 0 and b.finish_time == pytest.approx(1.12)
    else:
        assert copies == [(4, pytest.approx(0.825), pytest.approx(1.025))]  # 100 x 4 MB, 2 GB/s
        assert b.cached_len == 400 and b.finish_time == pytest.approx(1.045)
        assert b.ttft == pytest.approx(1.045 - 0.62)
    assert len(scheds[0].backend.waits) == 0 and scheds[0].copies.in_flight == {}


@pytest.mark.parametrize("fail_at", [None, 7.0])
def test_a_prefill_held_for_a_copy_starts_when_its_source_host_fails(fail_at):
    """The scenario above on two hosts of one GPU, copies across them at 2 MB/s: r2's 7-block
    copy (3.584 MB) runs from 6.0 to 7.792 s, and its prefill waits for it (as the live
    backends do: `serving.fetch_wait`). When the source's host fails at 7.0 s the copy never
    lands and r2 starts at once, on its local (empty) prefix: TTFT = 1.0 + 4.196 s, not the
    copy's end + 4.196 s. r1, running on the lost worker, fails."""
    from serving.policy.fetch_router import FetchingVertumnusRouter

    kv_bytes, gbps = 1000, 0.002
    reqs = [make_request("r0", 0.0, 4096, range(1, 9)),
            make_request("r1", 5.0, 10_000, [1] + list(range(100, 119))),
            make_request("r2", 6.0, 4096, list(range(1, 8)) + [50])]
    workers = layout_workers([1, 1], kv_blocks_per_device=100, max_input_len=20_000,
                             devices_per_host=1)
    cost = LinearCost()
    cfg = SimConfig(kv_bytes_per_token=kv_bytes, kv_transfer_gb_per_s=0.0,
                    scaleout_gb_per_s=gbps, first_token_seconds=0.0, tick_interval=0.0,
                    gpus_per_host=1, host_failures=((0, fail_at, None),) if fail_at else ())
    router = FetchingVertumnusRouter(kv_bytes, 100.0, cost_model=cost, scaleout_gb_per_s=gbps)
    scheds = []
    records = {r.request.request_id: r for r in simulate(
        reqs, workers, cost, router, cost, cfg, setup=[scheds.append])}
    assert [records[k].worker_id for k in ("r0", "r1", "r2")] == [0, 0, 1]
    copy = 7 * 512 * kv_bytes / (gbps * 1e9)
    if fail_at is None:
        assert records["r2"].cached_len == 7 * 512
        assert records["r2"].ttft == pytest.approx(copy + 0.612)
    else:
        assert not records["r1"].ok and records["r2"].ok
        assert records["r2"].cached_len == 0
        assert records["r2"].ttft == pytest.approx(fail_at - 6.0 + 4.196)
    assert len(scheds[0].backend.waits) == 0 and scheds[0].backend.waits.started == 1
