"""Workload shaping, reuse statistics and the Tool-Agent generator."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from eval.traces.workloads import (ToolAgentConfig, native_rate, prefix_hit_tokens, retime,
                            reuse_fraction, scale_to_rate, tool_agent_workload, workload_stats)
from serving.policy.request import Request, chain_block_hashes


def req(rid, t, n=10, ids=None, bs=4):
    ids = list(range(-(-n // bs))) if ids is None else ids
    return Request(rid, float(t), n, 3, chain_block_hashes(ids), bs)


def test_scale_to_rate_hand_case():
    reqs = [req("a", 0), req("b", 1), req("c", 3), req("d", 4)]
    assert native_rate(reqs) == pytest.approx(3 / 4)
    fast = scale_to_rate(reversed(reqs), 1.5)  # input order does not matter: sorted by arrival
    assert [r.request_id for r in fast] == ["a", "b", "c", "d"]
    assert [r.arrival_time for r in fast] == pytest.approx([0, 0.5, 1.5, 2.0])
    assert native_rate(fast) == pytest.approx(1.5)
    slow = scale_to_rate(reqs, 0.375)
    assert [r.arrival_time for r in slow] == pytest.approx([0, 2, 6, 8])
    assert reqs[1].arrival_time == 1.0  # inputs untouched
    with pytest.raises(ValueError, match="rate"):
        scale_to_rate(reqs, 0.0)
    with pytest.raises(ValueError, match="native rate"):
        scale_to_rate([req("a", 2), req("b", 2)], 1.0)


def test_retime_truncates_and_cycles():
    reqs = [req(str(i), 100 + 5 * i) for i in range(6)]
    src = [req("s0", 10), req("s3", 16), req("s1", 11), req("s2", 13)]  # gaps 1, 2, 3
    short = retime(reqs[:3], src)
    assert [r.arrival_time for r in short] == [0, 1, 3]
    long = retime(reqs, np.array([16.0, 10.0, 11.0, 13.0]))
    assert [r.arrival_time for r in long] == [0, 1, 3, 6, 7, 9]
    assert [r.request_id for r in long] == [str(i) for i in range(6)]
    assert [r.block_hashes for r in long] == [r.block_hashes for r in reqs]
    with pytest.raises(ValueError, match="arrivals_from"):
        retime(reqs, [req("x", 1.0)])


def test_reuse_fraction_hand_case():
    r1 = req("r1", 0, n=10, ids=[7, 8, 9])    # cold; leaves blocks (7), (7, 8)
    r2 = req("r2", 1, n=9, ids=[7, 8, 5])     # hits 2 blocks = 8 tokens
    r3 = req("r3", 2, n=8, ids=[7, 8])        # 2 full blocks, but the last token is
    #                                            recomputed: max_cacheable = 7 // 4 = 1 -> 4 tokens
    r4 = req("r4", 3, n=12, ids=[6, 8, 9])    # same content id 8 at block 1, other prefix: 0
    hits = prefix_hit_tokens([r4, r2, r3, r1])  # sorted by arrival inside
    assert hits.tolist() == [0, 8, 4, 0]
    assert reuse_fraction([r1, r2, r3, r4]) == pytest.approx(12 / 39)
    with pytest.raises(ValueError, match="block_size"):
        prefix_hit_tokens([r1, req("x", 5, n=10, bs=2)])


def test_workload_stats_hand_case():
    reqs = [req("a", 0, n=10), req("b", 2, n=20), req("c", 4, n=30), req("d", 8, n=100)]
    s = workload_stats(reqs)
    assert (s["count"], s["duration_s"]) == (4, 8.0)
    assert s["rate"] == pytest.approx(3 / 8)
    assert s["input_mean"] == pytest.approx(40.0)
    assert s["input_p50"] == pytest.approx(25.0)
    assert s["input_p90"] == pytest.approx(30 + 0.7 * 70)  # linear: rank 2.7
    assert s["output_mean"] == 3.0
    assert s["reuse"] == pytest.approx(reuse_fraction(reqs))


@pytest.fixture(scope="module")
def agent():
    return tool_agent_workload(duration_s=1800.0, seed=0)


def test_tool_agent_matches_published_statistics(agent):
    s = workload_stats(agent)
    # Mooncake tool-agent trace (FAST'25): 6.6 req/s, input 8,596, output 182, 59 % reusable.
    assert s["rate"] == pytest.approx(6.6, rel=0.10)
    assert s["input_mean"] == pytest.approx(8596, rel=0.10)
    assert s["output_mean"] == pytest.approx(182, rel=0.10)
    assert s["reuse"] == pytest.approx(0.59, rel=0.10)
    assert s["count"] == pytest.approx(6.6 * 1800, rel=0.10)
    t = [r.arrival_time for r in agent]
    assert t == sorted(t) and 0 <= t[0] and t[-1] < 1800.0


def test_tool_agent_chains_are_content_based(agent):
    bs = 512
    by_id = {r.request_id: r for r in agent}
    extended = 0
    for r in agent:
        s, j = r.request_id.split(":")[1].split(".")
        prev = by_id.get(f"toolagent:{s}.{int(j) - 1}")
        if prev is not None:  # call j re-sends call j-1's prompt: its full blocks are a prefix
            assert r.arrival_time > prev.arrival_time and r.input_len > prev.input_len
            full = prev.input_len // bs
            assert r.block_hashes[:full] == prev.block_hashes[:full]
            assert r.block_hashes[full:full + 1] != prev.block_hashes[full:full + 1]
            extended += 1
    assert extended > 0.3 * len(agent)
    # First calls of different sessions share only a template head: 0 or 3..5 full blocks.
    firsts = [r for r in agent if r.request_id.endswith(".0")][:300]
    shared = collections.Counter()
    for a, b in zip(firsts, firsts[1:]):
        k = 0
        while k < min(len(a.block_hashes), len(b.block_hashes)) and \
                a.block_hashes[k] == b.block_hashes[k]:
            k += 1
        shared[k] += 1
    assert set(shared) <= {0, 3, 4, 5} and sum(shared[k] for k in (3, 4, 5)) > 0


def test_tool_agent_deterministic_and_seeded():
    a = tool_agent_workload(duration_s=120.0, seed=5)
    b = tool_agent_workload(duration_s=120.0, seed=5)
    c = tool_agent_workload(duration_s=120.0, seed=6)
    assert [(r.request_id, r.arrival_time, r.block_hashes) for r in a] == \
           [(r.request_id, r.arrival_time, r.block_hashes) for r in b]
    assert [r.block_hashes for r in a[:50]] != [r.block_hashes for r in c[:50]]
    small = tool_agent_workload(duration_s=120.0, seed=5, block_size=256)
    assert [r.input_len for r in small] == [r.input_len for r in a]
    assert all(len(r.block_hashes) == -(-r.input_len // 256) for r in small)


def test_tool_agent_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rate"):
        tool_agent_workload(duration_s=10.0, rate=0.0)
    with pytest.raises(ValueError, match="duration_s"):
        tool_agent_workload(duration_s=-1.0)
    with pytest.raises(ValueError, match="block_size"):
        tool_agent_workload(duration_s=10.0, block_size=0)
    # Single-call sessions (mean_steps 1) are valid too.
    reqs = tool_agent_workload(duration_s=60.0, config=ToolAgentConfig(mean_steps=1.0))
    assert all(r.request_id.endswith(".0") for r in reqs)


@pytest.mark.parametrize("kw,field", [(dict(mean_steps=0.5), "mean_steps"),
                                      (dict(shared_head_tokens=(3000, 7000)), "shared_head_tokens"),
                                      (dict(tool_mean=0.0), "tool_mean"),
                                      (dict(num_templates=0), "num_templates")])
def test_tool_agent_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        ToolAgentConfig(**kw)


def test_retime_accepts_plain_lists_of_times():
    reqs = [req(str(i), 100 + 5 * i) for i in range(5)]
    times = [16.0, 10.0, 11.0, 13.0]  # unsorted; gaps 1, 2, 3 once sorted
    want = [0.0, 1.0, 3.0, 6.0, 7.0]   # cycled after m - 1 = 3 gaps
    for src in (times, tuple(times), np.asarray(times), (t for t in times),
                [req(f"s{i}", t) for i, t in enumerate(times)]):
        assert [r.arrival_time for r in retime(reqs, src)] == want
    assert [r.arrival_time for r in retime(reqs, [1, 3])] == [0.0, 2.0, 4.0, 6.0, 8.0]
    with pytest.raises(ValueError, match="arrivals_from"):
        retime(reqs, [1.0])
    with pytest.raises(ValueError, match="arrivals_from"):
        retime(reqs, [])
    with pytest.raises(ValueError, match="not a mix"):
        retime(reqs, [req("s", 1.0), 2.0])
    with pytest.raises(ValueError, match="arrivals_from"):
        retime(reqs, ["soon", "later"])


def test_scale_to_rate_undefined_native_rate():
    for reqs in ([req("a", 5.0)], [], [req("a", 3.0)] * 3):
        with pytest.raises(ValueError, match="native rate"):
            scale_to_rate(reqs, 1.0)


def test_tool_agent_size_guards():
    with pytest.raises(ValueError, match=r"rate must be in \(0, 10000\]"):
        tool_agent_workload(duration_s=1e-3, rate=1e4 * (1 + 1e-12))
    with pytest.raises(ValueError, match="rate"):
        tool_agent_workload(duration_s=1.0, rate=1e30)
    with pytest.raises(ValueError, match=r"duration_s \* rate"):
        tool_agent_workload(duration_s=1e7 / 6.6 * 1.001, rate=6.6)
    with pytest.raises(ValueError, match="warmup_s"):
        tool_agent_workload(duration_s=1.0, rate=6.6, config=ToolAgentConfig(warmup_s=1e9))
    with pytest.raises(ValueError, match="block_size"):
        tool_agent_workload(duration_s=10.0, block_size=True)
    # The largest allowed rate works. Without warm-up, sessions start at 1e4 / E[calls] = 1e4 /
    # (1 - 0.5^16) / 0.5 ~ 5,000 per s, so ~Poisson(50) starts in 10 ms; a follow-up call comes
    # >= output / 50 tok/s >= 20 ms later, so only first calls (".0") fall in [0, 0.01).
    reqs = tool_agent_workload(duration_s=0.01, rate=1e4, config=ToolAgentConfig(warmup_s=0.0))
    assert 50 - 4 * 50**0.5 <= len(reqs) <= 50 + 4 * 50**0.5
    assert all(r.request_id.endswith(".0") and 0.0 <= r.arrival_time < 0.01 for r in reqs)
