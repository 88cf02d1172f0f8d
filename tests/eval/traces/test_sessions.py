"""Agent sessions: the loader (format, re-blocking, shared prefix) and the closed-loop replay,
checked against hand-computed times and on the public sessions when present."""

from __future__ import annotations

import json

import pytest

from eval.sim.simulator import SimConfig, simulate
from eval.traces.closed_loop import ClosedLoop, session_starts
from eval.traces.loaders import load_trace
from eval.traces.parsing import TraceFormatError
from eval.traces.sessions import load_sessions
from serving.policy.request import num_blocks
from serving.policy.router import LeastWorkRouter
from serving.policy.worker import layout_workers
from tests.eval.traces.trace_fixtures import TRACES, common_prefix, need

AGENTS = TRACES / "agent_sessions"


def req(t, n_in, ids, out=10, think=None):
    r = {"t": t, "type": "n", "in": n_in, "out": out, "hash_ids": list(ids)}
    if think is not None:
        r["think_time"] = think
    return r


def write(folder, sessions):
    folder.mkdir(parents=True, exist_ok=True)
    for s in sessions:
        (folder / f"{s['id']}.json").write_text(json.dumps(s))
    return folder


def session(sid, requests, tool=0, system=0, bs=64):
    return {"id": sid, "block_size": bs, "hash_id_scope": "local", "tool_tokens": tool,
            "system_tokens": system, "requests": requests}


class LinearCost:
    """T = 0.1 s + 1 ms per new token (router estimate and ground truth alike)."""

    def predict(self, cp_degree, input_len, cached_len):
        return 0.1 + 1e-3 * (input_len - cached_len)

    __call__ = predict


def replay(workload, starts, tpot_s=0.01, workers=1, max_think_s=float("inf")):
    specs = layout_workers([1] * workers, kv_blocks_per_device=10_000, max_input_len=100_000)
    loop = ClosedLoop(workload, starts, tpot_s, max_think_s)
    cfg = SimConfig(kv_transfer_gb_per_s=0.0, first_token_seconds=0.02, tick_interval=0.0)
    records = simulate([], specs, LinearCost(), LeastWorkRouter(), LinearCost(), cfg,
                       arrivals=loop)
    return {r.request.request_id: r for r in records}, loop


def test_second_request_waits_for_the_first_response_plus_think_time(tmp_path):
    # r0 (640 tokens) arrives at 0, prefill 0.1 + 0.64 = 0.74 s, first token 0.76 s, 10 output
    # tokens x 10 ms: response ends at 0.86 s; think 2.0 s -> r1 arrives at 2.86 s. The recorded
    # t = 5 s of r1 is not used (closed loop). r1 shares r0's 10 blocks at block size 64:
    # 640 cached of 1280 -> prefill 0.1 + 0.64 = 0.74 s, first token at 2.86 + 0.76 = 3.62 s.
    folder = write(tmp_path / "s", [session("a", [
        req(0.0, 640, range(1, 11)), req(5.0, 1280, range(1, 21), think=2.0)])])
    w = load_sessions(folder, block_size=64)
    recs, loop = replay(w, [(0.0, 0)])
    r0, r1 = recs["a:0@0"], recs["a:1@0"]
    assert r0.first_token_time == pytest.approx(0.76)
    assert r1.request.arrival_time == pytest.approx(0.76 + 10 * 0.01 + 2.0)
    assert r1.cached_len == 640
    assert r1.first_token_time == pytest.approx(2.86 + 0.74 + 0.02)
    assert loop.sent == 2


def test_subagents_start_after_the_parent_response_and_the_parent_waits_for_them(tmp_path):
    # parent p0, then two sub-agents, then p1. The sub-agents start when p0's response ends
    # and run concurrently on separate workers; p1 is sent after the later of the two finished
    # (the source replayer: the parent pauses until all sub-agents complete), by the recorded
    # gap since the sub-agents ended: a sub-agent entry's `t` is its end, so 60 - 4.5 = 55.5 s
    # (p1's think_time, 50 s, counts from p0's response and so includes the sub-agents' run).
    # x has two requests (think 3 s), y one.
    x = {"t": 4.0, "type": "subagent", "agent_id": "x",
         "requests": [req(0.0, 128, [7, 8]), req(3.0, 192, [7, 8, 9], think=3.0)]}
    y = {"t": 4.5, "type": "subagent", "agent_id": "y", "requests": [req(0.0, 64, [5])]}
    folder = write(tmp_path / "s", [session("p", [
        req(1.0, 256, [1, 2, 3, 4]), x, y, req(60.0, 320, [1, 2, 3, 4, 5], think=50.0)])])
    w = load_sessions(folder, block_size=64)
    assert [s.session_id for s in w.sessions] == ["p", "p/x", "p/y"] and w.roots == (0,)
    recs, _ = replay(w, [(10.0, 0)], workers=3)
    end = {k: r.first_token_time + 10 * 0.01 for k, r in recs.items()}
    assert recs["p:0@0"].request.arrival_time == 10.0
    assert recs["p/x:0@0"].request.arrival_time == pytest.approx(end["p:0@0"])
    assert recs["p/y:0@0"].request.arrival_time == pytest.approx(end["p:0@0"])
    assert recs["p/x:1@0"].request.arrival_time == pytest.approx(end["p/x:0@0"] + 3.0)
    last = max(end["p/x:1@0"], end["p/y:0@0"])
    assert last == end["p/x:1@0"]
    assert recs["p:1@0"].request.arrival_time == pytest.approx(last + 55.5)
    # think times are capped by max_think_s
    capped, _ = replay(w, [(10.0, 0)], workers=3, max_think_s=20.0)
    assert capped["p:1@0"].request.arrival_time == pytest.approx(last + 20.0)


def test_a_failed_request_ends_its_response_at_the_failure(tmp_path):
    # r0 is longer than any worker holds: failed at its arrival (0); r1 is sent think 1.5 s later.
    folder = write(tmp_path / "s", [session("f", [
        req(0.0, 200_000, range(3125)), req(1.0, 64, [9], think=1.5)])])
    recs, loop = replay(load_sessions(folder, block_size=64), [(0.0, 0)])
    assert not recs["f:0@0"].ok and "cannot be held" in recs["f:0@0"].error
    assert recs["f:1@0"].request.arrival_time == pytest.approx(1.5) and recs["f:1@0"].ok


def test_reblocking_keeps_the_chain_structure(tmp_path):
    # 64-token source blocks re-blocked to 512: a and b share source blocks 0..11 (768 tokens),
    # so exactly one 512-block; a and c share 0..15 (1024 tokens): two blocks.
    a = list(range(1, 25))  # 1536 tokens
    b = a[:12] + [100 + i for i in range(12)]
    c = a[:16] + [200 + i for i in range(8)]
    folder = write(tmp_path / "s", [session("r", [req(0, 1536, a), req(0, 1536, b, think=0),
                                                  req(0, 1536 + 40, c, think=0)])])
    w = load_sessions(folder, block_size=512)
    ha, hb, hc = (r.block_hashes for r in w.requests)
    assert len(hc) == num_blocks(1576, 512) == 4
    assert common_prefix(ha, hb) == 1 and common_prefix(ha, hc) == 2
    # at the source's own block size the sharing is block for block
    w64 = load_sessions(folder, block_size=64)
    ha, hb, _ = (r.block_hashes for r in w64.requests)
    assert common_prefix(ha, hb) == 12


def test_warm_prefix_is_shared_by_all_sessions_as_far_as_asked(tmp_path):
    # Two sessions with different local ids; tool + system = 640 + 384 = 1024 tokens (16 blocks
    # of 64). warm_prefix_pct of it is one canonical prefix: 1.0 -> 16 source blocks = 2 blocks
    # of 512 shared; 0.5 -> 1 block; 0 -> nothing. A third session with a smaller prefix (512
    # tokens) shares its own half (256 tokens: no full 512-block) and nothing more.
    s1 = session("s1", [req(0, 2048, range(1, 33))], tool=640, system=384)
    s2 = session("s2", [req(0, 2048, range(500, 532))], tool=640, system=384)
    s3 = session("s3", [req(0, 2048, range(900, 932))], tool=512, system=0)
    folder = write(tmp_path / "s", [s1, s2, s3])
    for pct, want in ((1.0, 2), (0.5, 1), (0.0, 0)):
        w = load_sessions(folder, block_size=512, warm_prefix_pct=pct)
        a, b, c = (r.block_hashes for r in w.requests)
        assert common_prefix(a, b) == want and w.shared_blocks[:2] == (want, want), pct
        assert common_prefix(a, c) == (1 if pct == 1.0 else 0)
    with pytest.raises(ValueError, match="warm_prefix_pct"):
        load_sessions(folder, warm_prefix_pct=1.5)


def test_instances_of_one_session_share_only_the_shared_prefix(tmp_path):
    s1 = session("s1", [req(0, 2048, range(1, 33)), req(0, 2560, range(1, 41), think=1.0)],
                 tool=640, system=384)
    w = load_sessions(write(tmp_path / "s", [s1]), block_size=512, warm_prefix_pct=1.0)
    loop = ClosedLoop(w, [(0.0, 0), (5.0, 0)], tpot_s=0.0)
    (t0, a), (t1, b) = loop.start()
    assert (t0, t1) == (0.0, 5.0) and a.request_id == "s1:0@0" and b.request_id == "s1:0@1"
    assert common_prefix(a.block_hashes, b.block_hashes) == 2  # the tool + system blocks
    assert len(set(a.block_hashes[2:]) & set(b.block_hashes)) == 0
    [(t, a1)] = loop.on_end("s1:0@0", 3.0)
    assert t == 4.0 and common_prefix(a.block_hashes, a1.block_hashes) == 4  # own chain kept
    with pytest.raises(KeyError):
        loop.on_end("s1:0@0", 3.0)  # each request ends once


def test_session_starts_poisson_and_round_robin():
    class W:
        roots = (0, 1, 2)
    starts = session_starts(W, rate=2.0, window_s=500.0, seed=3)
    times = [t for t, _ in starts]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 500.0
    assert 900 < len(starts) < 1100  # Poisson(1000)
    roots = [r for _, r in starts]
    assert sorted(roots[:3]) == [0, 1, 2] and roots[3:6] == roots[:3]
    assert starts == session_starts(W, rate=2.0, window_s=500.0, seed=3)
    with pytest.raises(ValueError, match="rate"):
        session_starts(W, rate=0.0, window_s=1.0, seed=0)


@pytest.mark.parametrize("bad, field", [
    ({"in": 640, "hash_ids": [1, 2]}, "hash_ids must have floor"),
    ({"in": 0, "hash_ids": []}, r"requests\[0\].in"),
    ({"in": 64, "hash_ids": [-1]}, "hash_ids must be a list"),
    ({"in": 64, "hash_ids": [1], "think_time": -2}, "think_time"),
])
def test_malformed_session_files_name_the_field(tmp_path, bad, field):
    row = {"t": 0.0, "type": "n", "out": 1, **bad}
    folder = write(tmp_path / "s", [session("bad", [row])])
    with pytest.raises(TraceFormatError, match=field):
        load_sessions(folder)
    write(folder, [session("good", [req(0, 64, [1])])])
    w = load_sessions(folder, skip_malformed=True)
    assert w.skipped == 1 and [r.request_id for r in w.requests] == ["good:0"]


def test_load_trace_detects_a_folder_of_sessions(tmp_path):
    folder = write(tmp_path / "s", [session("a", [req(0, 64, [1])])])
    assert load_trace(folder).roots == (0,)
    assert load_trace(f"sessions:{folder}").roots == (0,)


def test_public_agent_sessions_load_and_replay():
    need(AGENTS)
    w = load_sessions(AGENTS, block_size=512)
    assert len(w.roots) == 160 and len(w.requests) == 9402
    assert all(len(r.block_hashes) == num_blocks(r.input_len, 512) for r in w.requests)
    # the first requests of the first session, one instance, on 8 CP-1 workers
    one = ClosedLoop(w, [(0.0, 0)], tpot_s=0.03)
    first = one.start()
    assert len(first) >= 1 and first[0][0] == 0.0


def test_duplicate_ids_name_both_files_and_bad_paths_are_format_errors(tmp_path):
    folder = write(tmp_path / "s", [session("a", [req(0, 64, [1])])])
    (folder / "copy.json").write_text((folder / "a.json").read_text())
    with pytest.raises(TraceFormatError, match="a:0 is also in a.json"):
        load_sessions(folder)
    assert load_sessions(folder, skip_malformed=True).skipped == 1
    (folder / "dir.json").mkdir()  # a folder named like a session file is not one
    (folder / "UPPER.JSON").write_text(json.dumps(session("b", [req(0, 64, [1])])))
    w = load_sessions(folder, skip_malformed=True)
    assert sorted(r.request_id for r in w.requests) == ["a:0", "b:0"]
    with pytest.raises(TraceFormatError, match="no such file or folder"):
        load_sessions(tmp_path / "missing")
    ragged = write(tmp_path / "r", [session("r", [req(0, 128, [1, 2])])])
    obj = json.loads((ragged / "r.json").read_text())
    obj["requests"][0]["hash_ids"] = [[1], [2, 3]]
    (ragged / "r.json").write_text(json.dumps(obj))
    with pytest.raises(TraceFormatError, match=r"requests\[0\].hash_ids"):
        load_sessions(ragged)
