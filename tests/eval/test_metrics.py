"""Metric formulas on a hand-made case."""

from __future__ import annotations

import pytest

from eval.metrics import summarize
from eval.slo import SloSpec, assign_slos
from serving.policy.request import Request, chain_block_hashes
from serving.policy.request import RequestRecord


def rec(rid, arrival, length, slo, start, finish, first, cached=0, cp=2, error=None):
    req = Request(rid, arrival, length, 1, chain_block_hashes(range(-(-length // 100))), 100, slo)
    return RequestRecord(req, 0, cp, 0, start, finish, first, cached, 0, 0.0, error)


def test_hand_made_case():
    records = [
        rec("a", 0.0, 100, 1.0, 0.0, 0.5, 0.5),              # TTFT 0.5, meets
        rec("b", 1.0, 300, 1.0, 1.0, 2.5, 3.0, cached=200),  # TTFT 2.0, misses
        rec("c", 2.0, 600, 2.0, 2.5, 3.0, 3.5, cp=4),        # TTFT 1.5, meets
        rec("d", 3.0, 1000, 1.0, None, 3.0, None, error="too long"),  # failed, misses
    ]
    m = summarize(records)
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert m["mean_ttft_ms"] == pytest.approx(4000 / 3)
    assert m["median_ttft_ms"] == pytest.approx(1500)
    # linear percentile of [0.5, 1.5, 2.0] at 90: 1.5 + 0.8 * 0.5 = 1.9
    assert m["p90_ttft_ms"] == pytest.approx(1900)
    assert m["slo_attainment"] == pytest.approx(2 / 4)
    assert m["token_weighted_slo_attainment"] == pytest.approx((100 + 600) / 2000)
    assert m["duration_s"] == pytest.approx(3.5)
    assert m["request_goodput"] == pytest.approx(2 / 3.5)
    assert m["prefix_hit_rate"] == pytest.approx(200 / 1000)
    assert m["gpu_seconds"] == pytest.approx(2 * 0.5 + 2 * 1.5 + 4 * 0.5)
    assert m["mean_queue_ms"] == pytest.approx((0 + 0 + 500) / 3)


def test_empty_run():
    m = summarize([])
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["slo_attainment"] is None


def test_slo_specs():
    reqs = [Request(i, 0.0, n, 1, chain_block_hashes(range(-(-n // 512))), 512) for i, n in
            enumerate([512, 2048])]
    iso = lambda n: 0.1 + n * 1e-4
    assert [r.ttft_slo for r in assign_slos(reqs, SloSpec.parse("scale:5"), iso)] == pytest.approx(
        [5 * (0.1 + 0.0512), 5 * (0.1 + 0.2048)])
    assert [r.ttft_slo for r in assign_slos(reqs, SloSpec.parse("fixed:2"), iso)] == [2.0, 2.0]
    assert [r.ttft_slo for r in assign_slos(reqs, SloSpec.parse("affine:0.5,0.25"), iso)] == \
        pytest.approx([0.5 + 0.128, 0.5 + 0.512])
    for bad in ("scale:0", "fixed:-1", "affine:1", "bogus:1", "scale:x", "affine:0,0"):
        with pytest.raises(ValueError, match="slo="):
            SloSpec.parse(bad)
