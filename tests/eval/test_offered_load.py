"""The demand sample of closed-loop sessions and the KV share its what-if replays run at."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from eval.experiment import ReplayConfig, ReplayEnv
from eval.offered_load import SessionLoad
from eval.sim.simulator import SimConfig, simulate
from eval.traces.closed_loop import session_starts
from eval.traces.sessions import load_sessions
from eval.whatif_sim import replay_choice
from serving.policy.cost_router import VertumnusRouter
from serving.policy.prefix_index import PrefixIndex
from serving.policy.request import Request, chain_block_hashes
from serving.policy.worker import layout_workers


def write_sessions(folder):
    # a: two turns (640 then 1,280 tokens, 10 output tokens each, think 2 s before the second);
    # b: one turn of 256 tokens and 30 output tokens.
    folder.mkdir()
    a = {"id": "a", "block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": 0.0, "type": "n", "in": 640, "out": 10, "hash_ids": list(range(1, 11))},
        {"t": 5.0, "type": "n", "in": 1280, "out": 10, "hash_ids": list(range(1, 21)),
         "think_time": 2.0}]}
    b = {"id": "b", "block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": 0.0, "type": "n", "in": 256, "out": 30, "hash_ids": [1, 2, 3, 4]}]}
    for s in (a, b):
        (folder / f"{s['id']}.json").write_text(json.dumps(s))
    return load_sessions(folder, block_size=64)


def test_demand_sample_is_the_runs_start_on_an_idle_pool(tmp_path):
    # Each instance's first turn arrives at its start (the simulator's own `session_starts`),
    # a's second turn 10 x 10 ms of decode plus 2 s of think after it: by hand from the starts.
    w = write_sessions(tmp_path / "s")
    load = SessionLoad(w, tpot_s=0.01, window_s=60.0, max_think_s=float("inf"), seed=3)
    starts = session_starts(w, 0.2, 60.0, 3)
    assert len(starts) >= 4
    expected = []
    for i, (t0, root) in enumerate(starts):
        sid = w.sessions[w.roots[root]].session_id
        expected.append((t0, f"{sid}:0@{i}"))
        if sid == "a":
            expected.append((t0 + 0.1 + 2.0, f"a:1@{i}"))
    expected.sort()
    sample = load.demand_sample(0.2, 1000)
    assert [r.request_id for r in sample] == [rid for _, rid in expected]
    assert [r.arrival_time for r in sample] == pytest.approx([t for t, _ in expected])
    short = load.demand_sample(0.2, 3)
    assert [r.request_id for r in short] == [rid for _, rid in expected[:3]]


def test_replay_kv_share_is_the_ramps_share_of_the_busiest_working_set(tmp_path):
    # Instance durations on an idle pool: a = 10 x 10 ms + think 2 s + 10 x 10 ms = 2.2 s,
    # b = 30 x 10 ms = 0.3 s. A sample spanning t seconds holds (min(2.2, t) + min(0.3, t))
    # of the run's busiest (min(2.2, W) + min(0.3, W)), W the start window.
    w = write_sessions(tmp_path / "s")
    load = SessionLoad(w, tpot_s=0.01, window_s=60.0, max_think_s=float("inf"))
    assert load.instance_seconds() == pytest.approx([2.2, 0.3])

    def at(*times):
        return [Request(f"r{i}", t, 64, 1, (i,), 64) for i, t in enumerate(times)]

    assert load.replay_kv_share(at(5.0, 6.0)) == pytest.approx((1.0 + 0.3) / 2.5)
    assert load.replay_kv_share(at(6.0, 5.0)) == pytest.approx((1.0 + 0.3) / 2.5)  # unsorted
    assert load.replay_kv_share(at(0.0, 0.2)) == pytest.approx(0.4 / 2.5)
    assert load.replay_kv_share(at(0.0, 3.0)) == 1.0
    assert load.replay_kv_share(at(1.0)) == 1.0
    capped = SessionLoad(w, tpot_s=0.01, window_s=60.0, max_think_s=1.0)  # think capped: 1.2 s
    assert capped.replay_kv_share(at(0.0, 1.0)) == pytest.approx((1.0 + 0.3) / 1.5)
    # sessions start during the first second only: the run is busiest at 1 s, holding
    # min(2.2, 1) + min(0.3, 1) = 1.3 s of instance time
    short = SessionLoad(w, tpot_s=0.01, window_s=1.0, max_think_s=float("inf"))
    assert short.replay_kv_share(at(0.0, 0.2)) == pytest.approx(0.4 / 1.3)
    assert short.replay_kv_share(at(0.0, 5.0)) == 1.0


def test_instance_seconds_count_the_subagents_the_parent_waits_for(tmp_path):
    # p0 (10 tokens out) ends at 0.1 s; sub-agents x and y start then: x0 ends 0.2, x1 is sent
    # 3 s later and ends 3.3; y0 ends 0.2; p1 is sent 60 - 4.5 = 55.5 s after the later one
    # (a sub-agent entry's t is its end) and ends at 3.3 + 55.5 + 0.1 = 58.9 s.
    folder = tmp_path / "s"
    folder.mkdir()

    def req(t, n, ids, think=None):
        r = {"t": t, "type": "n", "in": n, "out": 10, "hash_ids": ids}
        return r if think is None else {**r, "think_time": think}

    x = {"t": 4.0, "type": "subagent", "agent_id": "x",
         "requests": [req(0.0, 128, [7, 8]), req(3.0, 192, [7, 8, 9], think=3.0)]}
    y = {"t": 4.5, "type": "subagent", "agent_id": "y", "requests": [req(0.0, 64, [5])]}
    (folder / "p.json").write_text(json.dumps({
        "id": "p", "block_size": 64, "hash_id_scope": "local", "requests": [
            req(1.0, 256, [1, 2, 3, 4]), x, y, req(60.0, 320, [1, 2, 3, 4, 5], think=50.0)]}))
    w = load_sessions(folder, block_size=64)
    load = SessionLoad(w, tpot_s=0.01, window_s=60.0, max_think_s=float("inf"))
    assert load.instance_seconds() == pytest.approx([58.9])


@pytest.mark.parametrize("field, value", [("tpot_s", float("nan")), ("tpot_s", -0.01),
                                          ("window_s", 0.0), ("window_s", float("inf")),
                                          ("max_think_s", -1.0), ("max_think_s", True)])
def test_session_load_names_a_bad_field(tmp_path, field, value):
    w = write_sessions(tmp_path / "s")
    kw = {**dict(tpot_s=0.01, window_s=60.0, max_think_s=60.0), field: value}
    with pytest.raises(ValueError, match=f"SessionLoad.{field}"):
        SessionLoad(w, **kw)


class Linear:
    """T = 10 ms + (L - h) ms / C."""

    def predict(self, c, n, h):
        return 0.01 + (n - h) * 1e-3 / c


def test_replay_at_a_kv_share_equals_a_simulation_on_smaller_caches():
    # 40 contexts of 8 blocks (4,096 tokens), each asked for 3 times in a random order, on one
    # CP-4 worker of 400 blocks (all fit): at share 0.25 the worker holds 100 blocks (12
    # contexts), so contexts are evicted and recomputed; the score equals a separate
    # simulation on 100-block workers (the reference), and is higher than at share 1.
    rng = np.random.default_rng(0)
    order = rng.permutation(np.repeat(np.arange(40), 3))
    t = np.cumsum(rng.exponential(0.5, len(order))).tolist()
    sample = [Request(f"r{i}", x, 4096 + 100, 1, chain_block_hashes(
        [int(c) * 100 + k for k in range(8)] + [10_000 + i]), 512)
        for i, (x, c) in enumerate(zip(t, order))]

    def workers(comp):
        return layout_workers(list(comp), 100, 100_000)

    def router():
        return VertumnusRouter()

    full = replay_choice([[4]], {"cost": router}, sample, workers, Linear())[2][((4,), "cost")]
    part = replay_choice([[4]], {"cost": router}, sample, workers, Linear(),
                         kv_share=0.25)[2][((4,), "cost")]
    small = [dataclasses.replace(s, kv_capacity_blocks=100) for s in workers([4])]
    records = simulate(sample, small, Linear(), router(), Linear().predict,
                       SimConfig(tick_interval=0.0), prefix_index=PrefixIndex())
    reference = sum(r.ttft for r in records) / len(records)
    assert full[0] == part[0] == 0
    assert part[1] == pytest.approx(reference)
    assert part[1] > full[1] * 1.05
    # A tiny share keeps each worker able to hold the longest prompt: nothing fails.
    tiny = replay_choice([[4]], {"cost": router}, sample, workers, Linear(), kv_share=1e-6)
    assert tiny[2][((4,), "cost")][0] == 0
    for bad in (0.0, 1.5, float("nan"), "0.5", None):
        with pytest.raises(ValueError, match="kv_share"):
            replay_choice([[4]], {"cost": router}, sample, workers, Linear(), kv_share=bad)


def test_demand_takes_a_given_sample_as_timed_and_counts_its_hits_within_it():
    env = ReplayEnv.build(ReplayConfig(num_gpus=8, degrees=(2,)), 512, {2})
    shared = [1, 2, 3, 4]
    sample = [Request("x", 10.0, 2100, 1, chain_block_hashes(shared + [90]), 512),
              Request("y", 12.5, 2100, 1, chain_block_hashes(shared + [91]), 512)]
    other = [Request(f"t{i}", 0.0, 1000, 1, chain_block_hashes([100 + i, 200 + i]), 512)
             for i in range(3)]
    d = env.demand(other, 4.0, sample=sample)
    # times from the sample's first arrival; y hits x's 4 full blocks: 0.75 x 2,048 tokens
    assert d.sample == ((0.0, 2100, 0), (2.5, 2100, 1536))
    assert [r.request_id for r in d.requests] == ["x", "y"]
    assert d.max_input_len == 1000 and d.rate == 4.0
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="sample_size"):
            env.demand(other, 4.0, sample_size=bad)
    with pytest.raises(ValueError, match="at least one request"):
        env.demand([], 4.0, sample=sample)
    for share in (0.0, 1.5, float("nan"), None):
        with pytest.raises(ValueError, match="replay_kv_share"):
            dataclasses.replace(d, replay_kv_share=share)
