"""Phased workloads for the reconfiguration experiment."""

from __future__ import annotations

import pytest

from eval.traces.scenarios import Phase, phase_of, phased_workload
from serving.policy.request import Request, chain_block_hashes


def source(n, gap):
    return [Request(i, i * gap, 600, 1, chain_block_hashes([i, i + 1]), 512) for i in range(n)]


def test_phases_back_to_back_at_their_rates():
    a, b = source(100, 1.0), source(50, 0.5)
    reqs = phased_workload([Phase("slow", a, 2.0, 10.0), Phase("fast", b, 8.0, 4.0)])
    slow = [r for r in reqs if phase_of(r.request_id) == "slow"]
    fast = [r for r in reqs if phase_of(r.request_id) == "fast"]
    # source a at 1 req/s scaled to 2 req/s: arrivals 0, 0.5, ..., 9.5 -> 20 requests in 10 s
    assert [r.arrival_time for r in slow] == pytest.approx([0.5 * k for k in range(20)])
    # b at 2 req/s scaled to 8 req/s: gaps 0.125 s from t = 10 s, 32 in 4 s
    assert len(fast) == 32 and fast[0].arrival_time == pytest.approx(10.0)
    assert fast[1].arrival_time - fast[0].arrival_time == pytest.approx(0.125)
    assert [r.arrival_time for r in reqs] == sorted(r.arrival_time for r in reqs)
    assert fast[0].request_id == "fast/0" and fast[0].block_hashes == b[0].block_hashes


def test_bad_phases():
    with pytest.raises(ValueError, match="no requests"):
        Phase("x", [], 1.0, 1.0)
    with pytest.raises(ValueError, match="rate and duration_s"):
        Phase("x", source(3, 1.0), 0.0, 1.0)
