"""The soak test's coroutines on hand-made HTTP answers (httpx's MockTransport, no server): the
request stream against a server that refuses everything, the split / merge driver against one
that refuses or rejects every operation; and `abandon` against a bare uvicorn app behind the
server's own `RequestGate` (the 100 Continue it relies on)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import uvicorn

from eval.live.soak_config import PromptSet, SoakConfig
from eval.live.soak_ledger import Outcome
from eval.live.soak_report import assemble, failures, verdict
from eval.live.soak_run import SoakRun
from eval.live.soak_server import abandon, check_counts
from serving.http_gate import RequestGate

_POOL = {"composition": [4, 4], "epoch": 0, "reconfigurations_in_progress": [],
         "reconfigurations": [],
         "workers": [{"worker_id": i, "cp_degree": 4, "first_device": 4 * i, "status": "active",
                      "queued_requests": 0, "running": False} for i in (0, 1)]}


def _server(op_status=409, completion=None):
    """A MockTransport handler: `/v1/workers` lists two idle CP-4 workers, split / merge answer
    `op_status`, completions `completion(request body)` (an `httpx.Response`)."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/workers":
            return httpx.Response(200, json=_POOL)
        if request.url.path.startswith("/v1/workers/"):
            return httpx.Response(op_status, json={"error": {"message": "no", "code": op_status}})
        return completion(json.loads(request.content))
    return handler


def _soak(handler, coro, **cfg):
    """Runs `coro(run)` on a `SoakRun` whose client talks to `handler`; returns (its value,
    the run)."""
    cfg = SoakConfig(**{"url": "http://soak.test", "admin_api_key": "k", "interval_s": 0.01,
                        "reconfig_timeout_s": 0.3, "progress_interval_s": 0.0,
                        "disconnect_fraction": 0.0, **cfg})

    async def main():
        async with httpx.AsyncClient(base_url=cfg.url,
                                     transport=httpx.MockTransport(handler)) as client:
            run = SoakRun(cfg, client, PromptSet(100, cfg.prompt_lengths, 2,
                                                  cfg.repeat_fraction, 0))
            return await coro(run), run
    return asyncio.run(main())


def test_refused_operations_stop_the_run_and_fail_it():
    """Operations refused (409) again and again do not reset the stall timer: the run stops
    after reconfig_timeout_s (not at max_duration_s) and fails."""
    t = time.monotonic()
    reason, run = _soak(_server(409), lambda run: run.drive(), max_duration_s=600.0)
    assert reason == "operations refused" and time.monotonic() - t < 5.0
    assert run.op_refused[409] >= 5 and not run.op_errors and not run.ops
    result = assemble(run, reason, _POOL, _POOL, 0.0, None)
    assert "the operations stopped early: operations refused" in failures(result)
    assert verdict(result) == "failed"


def test_a_400_to_a_legal_operation_is_a_failure():
    reason, run = _soak(_server(400), lambda run: run.drive())
    assert reason == "operations failed" and not run.op_refused
    assert run.op_errors[0]["status"] == 400 and run.op_errors[0]["kind"] == "split"
    bad = failures(assemble(run, reason, _POOL, _POOL, 0.0, None))
    assert any("answer other than 200 or 409" in b for b in bad)


def test_max_duration_before_the_operations_is_incomplete():
    reason, _ = _soak(_server(409), lambda run: run.drive(), max_duration_s=0.1,
                      reconfig_timeout_s=60.0)
    assert reason == "deadline"


def test_a_server_refusing_every_completion_fails():
    """Every completion answered 503 "cannot be held by any worker": all refused (labelled by
    the body), none answered, and the run fails on both counts."""
    def refuse(body):
        return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {
            "message": f"input_len={len(body['prompt'])} tokens cannot be held by any worker "
                       "(max_input_len <= 8 tokens); retry when the pool has merged workers"}})

    async def stream_briefly(run):
        task = asyncio.create_task(run.stream())
        await asyncio.sleep(0.2)
        run.stop.set()
        await task

    _, run = _soak(_server(completion=refuse), stream_briefly)
    s = run.ledger.summary()
    assert s["sent"] > 5 and s["refused"] == s["sent"] and s["answered"] == 0
    assert s["refused_reasons"] == {"no worker fits": s["sent"]}
    start = {"success": 0, "failure": 0, "aborted": 0, "rejected": 0, "rejected_by_reason": {}}
    counts = check_counts(start, {**start, "rejected": s["sent"]}, s)
    assert counts["problems"] == []  # consistent: the server refused what it says it refused
    bad = failures(assemble(run, "done", _POOL, _POOL, 0.0, counts))
    assert len(bad) == 2 and "more than --max_refused_fraction=0.001" in bad[0]
    assert "no request was answered" in bad[1]


def test_a_swapped_answer_is_lost():
    """A server answering each request with a fixed prompt_tokens: answers whose length differs
    from the prompt sent are lost (lengths are drawn from 12..40)."""
    def answer(body):
        return httpx.Response(200, json={"id": f"cmpl-{body['user']}", "worker_id": 0,
                                         "cp_degree": 4, "choices": [{"token_ids": [1]}],
                                         "usage": {"prompt_tokens": 20}})

    async def stream_briefly(run):
        task = asyncio.create_task(run.stream())
        await asyncio.sleep(0.2)
        run.stop.set()
        await task

    # a rate cap, so that the sender yields (MockTransport answers without suspending)
    _, run = _soak(_server(completion=answer), stream_briefly, repeat_fraction=0.0, rate=500.0)
    s = run.ledger.summary()
    assert s["lost"] > 0.8 * s["sent"] and s["lost"] + s["answered"] == s["sent"]


def _serve_gated(app, api_key=None):
    """uvicorn serving `app` behind `RequestGate` on a free port; returns (server, its task)
    once it listens (call inside a running loop)."""
    gate = RequestGate(app, api_key=api_key, admin_api_key=None, max_body_bytes=100_000,
                       body_timeout=5.0)
    server = uvicorn.Server(uvicorn.Config(gate, host="127.0.0.1", port=0, lifespan="off",
                                           log_level="warning"))
    return server, asyncio.create_task(server.serve())


def test_abandon_closes_only_after_the_app_holds_the_body():
    seen: list = []

    async def app(scope, receive, send):  # reads the body, then waits for the client to go
        seen.append(json.loads((await receive())["body"])["user"])
        seen.append((await receive())["type"])

    async def main():
        server, task = _serve_gated(app)
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        outs = [await abandon(url, "/v1/completions", {"user": f"r{i}"},
                              {"X-Request-Id": f"r{i}"}, 0.005, 5.0) for i in range(5)]
        for _ in range(200):
            if len(seen) == 10:
                break
            await asyncio.sleep(0.01)
        server.should_exit = True
        await task
        return outs

    outs = asyncio.run(main())
    assert outs == [Outcome("abandoned", 100, "closed after 100 Continue")] * 5
    assert seen == [x for i in range(5) for x in (f"r{i}", "http.disconnect")]


def test_abandon_without_100_continue_is_lost():
    async def app(scope, receive, send):  # never reached: the gate answers 401 first
        raise AssertionError("the gate let a request without its key through")

    async def main():
        server, task = _serve_gated(app, api_key="secret")
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        out = await abandon(url, "/v1/completions", {"user": "x"}, {}, 0.0, 5.0)
        refused = await abandon("http://127.0.0.1:1", "/v1/completions", {}, {}, 0.0, 5.0)
        server.should_exit = True
        await task
        return out, refused

    out, refused = asyncio.run(main())
    assert out.kind == "lost" and out.status == 401 and "no 100 Continue" in out.detail
    assert refused.kind == "lost" and refused.status is None
