"""The load generator against a real HTTP server (uvicorn in a thread, fake backend, no JAX)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from eval.live.prompts import PromptScale, scaled_requests
from eval.live.client import compiled_executables, pool_changes, replay, wait_healthy, workload
from eval.metrics import summarize
from tests.serving.api_fixtures import make_client

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture()
def server_url():
    client, engine = make_client(seconds=0.02)
    server = uvicorn.Server(uvicorn.Config(client.app, host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 20
    while not server.started and time.monotonic() < end:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 20)
    yield url, engine
    server.should_exit = True
    thread.join(20)


def test_replay_builtin_workload(server_url):
    url, engine = server_url
    reqs, name = workload("", "auto", duration=3.0, rate=0.0, seed=0, trace_block_size=512)
    assert name == "toolagent" and len(reqs) >= 5
    pairs = scaled_requests(reqs, PromptScale(16, 256, max_len=1024), 16)
    t0 = time.perf_counter()
    records, state = asyncio.run(replay(url, pairs))
    wall = time.perf_counter() - t0
    assert len(records) == len(pairs) and all(r.ok for r in records), [r.error for r in records]
    # arrival times honoured: the run lasts at least the workload's span
    assert wall >= reqs[-1].arrival_time
    for rec, (req, tokens) in zip(records, pairs):
        assert rec.request is req
        assert rec.first_token == sum(tokens) % 256  # the fake backend's token
        assert rec.ttft >= rec.finish_time - rec.start_time > 0
    out = summarize(records)
    assert out["completed"] == len(pairs) and out["mean_ttft_ms"] > 0
    assert out["total_input_tokens"] == sum(len(t) for _, t in pairs)
    assert engine.scheduler.num_completed == len(pairs)
    assert state["composition"] == [4, 2, 2] and state["max_send_lag_s"] >= 0


def test_http_errors_become_failed_records(server_url):
    url, _ = server_url
    reqs, _ = workload("", "auto", duration=2.0, rate=0.0, seed=1, trace_block_size=512)
    pairs = scaled_requests(reqs[:2], PromptScale(16, 300, max_len=4096), 16)  # ids >= 256
    records, _ = asyncio.run(replay(url, pairs))
    assert all(not r.ok and r.error.startswith("HTTP 400") for r in records)


def test_pool_changes_counts_splits_and_merges(server_url):
    url, engine = server_url
    assert pool_changes(url) == (0, 0, [4, 2, 2])
    r = httpx.post(f"{url}/v1/workers/split", json={"worker_id": 0},
                   headers={"Authorization": "Bearer admin"}, timeout=10)
    assert r.status_code == 200, r.text
    finished, in_progress, _ = pool_changes(url)
    assert finished + in_progress == 1  # draining or re-carving, or already done
    end = time.monotonic() + 30
    while pool_changes(url)[0] < 1 and time.monotonic() < end:
        time.sleep(0.05)
    assert pool_changes(url) == (1, 0, [2, 2, 2, 2])
    assert len(engine.scheduler.reconfig.log) == 1


def test_compiled_executables_counts_each_workers_new_buckets(server_url):
    url, engine = server_url
    assert compiled_executables(url) == 0
    reqs, _ = workload("", "auto", duration=3.0, rate=0.0, seed=2, trace_block_size=512)
    pairs = scaled_requests(reqs, PromptScale(16, 256, max_len=1024), 16)
    records, _ = asyncio.run(replay(url, pairs))
    assert all(r.ok for r in records)
    engine.backend.workers[0].executables[((0,), 99)] = None  # worker 0 compiled one more
    # The fake backend's (worker devices, bucket) keys: what each worker has compiled.
    own = {i: len(w.executables) for i, w in engine.backend.workers.items()}
    assert sum(own.values()) >= 2 and compiled_executables(url) == sum(own.values())

    def per_worker():
        return {w["worker_id"]: w["prefill_executables"]
                for w in httpx.get(f"{url}/v1/workers", timeout=10).json()["workers"]}

    assert per_worker() == own
    # A split's halves share the old worker's dict (as vertumnus_jax.recarve does): its keys
    # name the old devices, so the halves have compiled nothing yet.
    r = httpx.post(f"{url}/v1/workers/split", json={"worker_id": 0},
                   headers={"Authorization": "Bearer admin"}, timeout=10)
    assert r.status_code == 200, r.text
    end = time.monotonic() + 30
    while pool_changes(url)[0] < 1 and time.monotonic() < end:
        time.sleep(0.05)
    halves = [i for i in engine.backend.workers if i not in own]
    assert len(halves) == 2 and engine.backend.workers[halves[0]].executables
    assert per_worker() == {**{i: n for i, n in own.items() if i != 0}, **dict.fromkeys(halves, 0)}
    # A worker retired by a re-carve but not yet replaced reports nothing (and no error).
    engine.backend.workers[halves[0]].retired = "merge"
    r = httpx.get(f"{url}/v1/workers", timeout=10)
    assert r.status_code == 200
    row = next(w for w in r.json()["workers"] if w["worker_id"] == halves[0])
    assert row["prefill_executables"] == 0 and row["kv_blocks_cached"] == 0


def test_cli_warms_up_until_quiet_and_reports_measured_compilations(server_url, tmp_path):
    url, engine = server_url
    cmd = [sys.executable, "-m", "eval.live.loadgen", f"--url={url}", "--duration=3",
           "--warmup_duration=2", "--warmup_rounds=4", "--settle_quiet_s=2",
           f"--output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rounds = [line for line in proc.stdout.splitlines() if line.startswith("warm-up ")]
    # Settled at the first round that created no executable in an unchanged pool, else ran
    # every round ("n/a": a split or merge changed the pool in that round).
    created = [line.rsplit(": ", 1)[1] for line in rounds]
    assert (created[-1] == "0" and "0" not in created[:-1]) or len(created) == 4, created
    (path,) = tmp_path.glob("vertumnus-tiny-toolagent-*.json")
    result = json.loads(path.read_text())
    assert result["completed"] > 0 and result["failed"] == 0
    # `vllm bench serve`'s keys too, TTFT statistics over the per-request `ttfts`
    n = result["num_prompts"]
    assert result["backend"] == "vertumnus" and result["model_id"] == "tiny"
    assert len(result["ttfts"]) == len(result["input_lens"]) == n == result["completed"]
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["output_lens"] == [1] * n and result["errors"] == [""] * n
    assert result["mean_ttft_ms"] == pytest.approx(1e3 * sum(result["ttfts"]) / n)
    assert result["settings"]["warmup_rounds"] == 4 and result["composition"]
    policy = httpx.get(f"{url}/v1/workers", timeout=10).json()["policy"]
    assert result["policy"] == policy and policy["name"] == engine.config.policy
    assert (f"policy: {policy['name']} ({policy['description']}; router "
            f"{policy['router']})") in proc.stdout
    assert result["measured_executables_created"] >= 0
    assert (f"prefill executables created during the measured run: "
            f"{result['measured_executables_created']}") in proc.stdout


def test_replay_sessions_closed_loop_against_a_server(server_url, tmp_path):
    """Two sessions of three requests (think 0.2 s, 5 output tokens at 10 ms), started 0.1 s
    apart: every request is sent only after its predecessor's response plus decode and think
    time, on the client's clock; the deadline drops what is due after it."""
    from eval.live.client import replay_sessions
    from eval.traces.closed_loop import ClosedLoop
    from eval.traces.sessions import load_sessions
    folder = tmp_path / "agents"
    folder.mkdir()
    for k in range(2):
        reqs = [{"t": float(j), "type": "n", "in": 64 * (4 + 2 * j), "out": 5,
                 "hash_ids": list(range(1, 5 + 2 * j)), "think_time": 0.2} for j in range(3)]
        (folder / f"s{k}.json").write_text(json.dumps(
            {"id": f"s{k}", "block_size": 64, "requests": reqs}))
    w = load_sessions(folder, block_size=64)
    url, _ = server_url
    scale = PromptScale(16, 256, max_len=1024)
    loop = ClosedLoop(w, [(0.0, 0), (0.1, 1)], tpot_s=0.01)
    records, state = asyncio.run(replay_sessions(
        url, loop, lambda r: scaled_requests([r], scale, 16)[0], deadline_s=60.0))
    assert len(records) == 6 and all(r.ok for r in records) and state["unsent_requests"] == 0
    by_id = {r.request.request_id: r for r in records}
    for s in ("s0", "s1"):
        for j in (1, 2):
            prev, cur = by_id[f"{s}:{j - 1}@{0 if s == 's0' else 1}"], by_id[f"{s}:{j}@{0 if s == 's0' else 1}"]
            # sent 5 x 10 ms of decode + 0.2 s of think after the previous response arrived
            assert cur.request.arrival_time == pytest.approx(prev.first_token_time + 0.05 + 0.2)
            assert cur.start_time >= cur.request.arrival_time
            assert cur.request.input_len == 16 * (4 + 2 * j)  # the scaled prompt the server saw
    # a deadline before the second requests are due: only the first of each session is sent
    loop = ClosedLoop(w, [(0.0, 0), (0.1, 1)], tpot_s=0.01)
    records, state = asyncio.run(replay_sessions(
        url, loop, lambda r: scaled_requests([r], scale, 16)[0], deadline_s=0.2))
    # the rest of both sessions (two requests each) is never sent
    assert len(records) == 2 and state["unsent_requests"] == 4
    loop = ClosedLoop(w, [(0.0, 0), (0.1, 1)], tpot_s=0.01)
    records, state = asyncio.run(replay_sessions(
        url, loop, lambda r: scaled_requests([r], scale, 16)[0], deadline_s=60.0,
        max_requests=3))
    assert len(records) == 3 and state["unsent_requests"] == 3


def test_cli_replays_agent_sessions_closed_loop(server_url, tmp_path):
    url, _ = server_url
    folder = tmp_path / "agents"
    folder.mkdir()
    for k in range(3):
        reqs = [{"t": float(j), "type": "n", "in": 64 * (4 + 2 * j), "out": 5,
                 "hash_ids": list(range(1, 5 + 2 * j)), "think_time": 0.1} for j in range(3)]
        (folder / f"s{k}.json").write_text(json.dumps(
            {"id": f"s{k}", "block_size": 64, "requests": reqs}))
    cmd = [sys.executable, "-m", "eval.loadgen", f"--url={url}", f"--trace={folder}",
           "--duration=2", "--session_rate=2", "--warmup_duration=0", "--trace_block_size=64",
           f"--output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "closed-loop" in proc.stdout
    (path,) = tmp_path.glob("vertumnus-tiny-agents-*.json")
    result = json.loads(path.read_text())
    assert result["replay"] == "closed-loop" and result["failed"] == 0
    assert result["completed"] + result["unsent_requests"] == 3 * result["sessions_started"]


def test_openai_backend_streams_from_our_server_too(server_url):
    """`backend="openai"` reads our server's SSE stream (`stream: true`) as vLLM's: one token
    chunk, a usage chunk, `[DONE]`; no `/v1/workers` state."""
    url, engine = server_url
    reqs, _ = workload("", "auto", duration=2.0, rate=0.0, seed=5, trace_block_size=512)
    pairs = scaled_requests(reqs[:4], PromptScale(16, 256, max_len=1024), 16)
    records, state = asyncio.run(replay(url, pairs, backend="openai", model="tiny"))
    assert all(r.ok for r in records), [r.error for r in records]
    assert [r.first_token for r in records] == [sum(t) % 256 for _, t in pairs]
    outs = state["outputs"]
    assert [o.output_tokens for o in outs] == [1] * 4 and all(o.ttft > 0 for o in outs)
    assert all(o.cached_tokens is not None for o in outs) and "composition" not in state
    assert engine.scheduler.num_completed == 4
