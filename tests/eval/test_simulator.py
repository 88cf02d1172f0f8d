"""The simulator with the scheduler core on hand-computed scenarios."""

from __future__ import annotations

import numpy as np
import pytest

from eval.metrics import summarize
from eval.simulator import SimConfig, simulate
from serving.request import Request, chain_block_hashes, num_blocks
from serving.router import LeastWorkRouter
from serving.worker import layout_workers


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
