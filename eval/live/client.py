"""HTTP client side of live runs: the workload to send, the replays, the server process.

Used by `eval.live.loadgen` (the CLI) and `eval.live.fidelity`. `replay` sends each request at
its arrival time (open loop); `replay_sessions` drives agent sessions closed-loop
(`eval.traces.closed_loop.ClosedLoop`: a session's next request is sent `think_time` after the
previous response ended). Both use asyncio + httpx and turn each response into a
`serving.policy.request.RequestRecord` with client-side times, so `eval.metrics.summarize`
reads live runs exactly as simulated ones, and an `eval.live.bench_result.RequestOutput` (the
`vllm bench serve` view of it).

`backend` picks the server: `"vertumnus"` (this project's: one non-streamed completion per
request, whose answer names the worker, CP degree, epoch and server timings; the pool's state
from `GET /v1/workers` after the last answer) or `"openai"` (any OpenAI-compatible server:
streamed completions timed as vLLM's benchmark, `eval.live.openai_stream`; no pool state).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import IO, NamedTuple

import httpx

from eval.live.bench_result import RequestOutput
from eval.live.openai_stream import post_stream
from eval.traces.closed_loop import ClosedLoop
from eval.traces.loaders import load_trace, sample_window
from eval.traces.sessions import SessionWorkload
from eval.traces.workloads import scale_to_rate, tool_agent_workload
from serving.policy.request import Request, RequestRecord

# `GET /v1/workers` with every finished split and merge the server keeps (it keeps the latest 256;
# `reconfigurations_total` counts them all).
_WORKERS_ALL = "/v1/workers?reconfigurations=256"
BACKENDS = ("vertumnus", "openai")


def workload(trace: str, fmt: str, duration: float, rate: float, seed: int,
             trace_block_size: int) -> tuple[list[Request] | SessionWorkload, str]:
    """The requests to send (arrival times from 0) and the workload's name; agent sessions
    (a folder) come back whole, as a `SessionWorkload`, for `replay_sessions`."""
    if not trace:
        reqs = tool_agent_workload(duration_s=duration, seed=seed, block_size=trace_block_size)
        name = "toolagent"
    else:
        t = load_trace(trace, fmt=fmt, block_size=trace_block_size, rate=rate or 1.0, seed=seed,
                       trace_block_size=trace_block_size)
        if isinstance(t, SessionWorkload):
            return t, t.name
        reqs, name = sample_window(t.requests, duration, seed), t.name
    if rate > 0 and reqs:
        reqs = scale_to_rate(reqs, rate)
    return reqs, name


# post(client, t0, sent, request, tokens) -> its record (and keeps its RequestOutput)
Post = Callable[[httpx.AsyncClient, float, float, Request, list[int]], Awaitable[RequestRecord]]


def _poster(backend: str, headers: dict, server_ttft: dict, outputs: dict, model: str | None,
            max_tokens: int) -> Post:
    """The request function of `backend`; it files each `RequestOutput` in `outputs` by id."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    async def post(client, t0, sent, request, tokens):
        if backend == "openai":
            record, out = await post_stream(client, t0, sent, request, tokens, headers, model,
                                            max_tokens)
        else:
            record, out = await _post(client, t0, sent, request, tokens, headers, server_ttft,
                                      model, max_tokens)
        outputs[request.request_id] = out
        return record
    return post


async def _send(client: httpx.AsyncClient, t0: float, request: Request, tokens: list[int],
                lags: list[float], post: Post) -> RequestRecord:
    delay = t0 + request.arrival_time - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter() - t0
    lags.append(max(0.0, sent - request.arrival_time))
    return await post(client, t0, sent, request, tokens)


async def _post(client: httpx.AsyncClient, t0: float, sent: float, request: Request,
                tokens: list[int], headers: dict, server_ttft: dict, model: str | None = None,
                max_tokens: int = 1) -> tuple[RequestRecord, RequestOutput]:
    """POSTs one completion to this project's server, sent at `sent` (seconds after t0); its
    record in client time and its `RequestOutput` (TTFT and latency: send to response)."""
    out = RequestOutput(prompt_len=len(tokens), start_time=sent)
    payload = {"prompt": tokens, "max_tokens": max_tokens, **({"model": model} if model else {})}
    try:
        resp = await client.post("/v1/completions", json=payload, headers=headers)
        body = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return RequestRecord(request, finish_time=time.perf_counter() - t0, error=out.error), out
    done = time.perf_counter() - t0
    if resp.status_code != 200:
        msg = body.get("error", {}).get("message", resp.text) if isinstance(body, dict) else resp.text
        out.error = f"HTTP {resp.status_code}: {msg}"
        return RequestRecord(request, finish_time=done, error=out.error), out
    tm = body["timings"]
    server_ttft[request.request_id] = tm["ttft_seconds"]
    start = sent + tm["queue_seconds"]
    choice = body["choices"][0]
    out.success, out.ttft = True, done - sent
    out.latency, out.generated_text = out.ttft, choice.get("text", "")
    out.output_tokens = int(body.get("usage", {}).get("completion_tokens") or 1)
    out.cached_tokens = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return RequestRecord(
        request, body["worker_id"], body["cp_degree"], body["epoch"], start,
        start + tm["prefill_seconds"], done, out.cached_tokens,
        first_token=choice["token_ids"][0]), out


def _client(url: str, timeout: float, transport: httpx.AsyncBaseTransport | None
            ) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, transport=transport)


async def _finish(client: httpx.AsyncClient, backend: str, headers: dict, t0: float,
                  lags: list[float], server_ttft: dict, outputs: dict) -> dict:
    """The state `replay` and `replay_sessions` return (their docs)."""
    duration = time.perf_counter() - t0
    state = ((await client.get(_WORKERS_ALL, headers=headers)).json()
             if backend == "vertumnus" else {})
    state["max_send_lag_s"] = max(lags, default=0.0)
    state["server_ttft_s"] = server_ttft
    state["outputs"] = sorted(outputs.values(), key=lambda o: o.start_time)
    state["duration_s"] = duration
    return state


async def replay(url: str, pairs: list[tuple[Request, list[int]]], api_key: str | None = None,
                 timeout: float = 600.0, *, backend: str = "vertumnus", model: str | None = None,
                 max_tokens: int = 1, transport: httpx.AsyncBaseTransport | None = None
                 ) -> tuple[list[RequestRecord], dict]:
    """Sends every (request, prompt) at its arrival time to `backend` (module doc).

    Args:
      model: the `model` field of each completion (None: left out; servers of one model
        accept that, vLLM included).
      max_tokens: tokens to generate per request (this project's server takes only 1).
      transport: an httpx transport (e.g. `httpx.ASGITransport` in tests); None = the network.

    Returns:
      The records (client-side times: sent at `arrival_time`, first token when the response
      arrived), in `pairs` order, and with `backend="vertumnus"` the server's `/v1/workers`
      state after the last answer (else an empty dict), plus `max_send_lag_s` (latest send
      behind schedule, seconds), `server_ttft_s` (request id -> TTFT the server measured,
      seconds, for completed requests of our server), `outputs` (the `RequestOutput`s in send
      order) and `duration_s` (start of the run to the last answer, seconds).

    Raises:
      ValueError: an unknown `backend`.
      httpx.HTTPError: `GET /v1/workers` failed after the run (our backend only; the requests
        themselves never raise, they fail in their records).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    lags: list[float] = []
    server_ttft: dict = {}
    outputs: dict = {}
    post = _poster(backend, headers, server_ttft, outputs, model, max_tokens)
    async with _client(url, timeout, transport) as client:
        t0 = time.perf_counter()
        records = await asyncio.gather(*(_send(client, t0, r, p, lags, post) for r, p in pairs))
        state = await _finish(client, backend, headers, t0, lags, server_ttft, outputs)
    return list(records), state


async def replay_sessions(url: str, loop: ClosedLoop,
                          prompt: Callable[[Request], tuple[Request, list[int]]],
                          deadline_s: float, max_requests: int = 0, api_key: str | None = None,
                          timeout: float = 600.0, *, backend: str = "vertumnus",
                          model: str | None = None, max_tokens: int = 1,
                          transport: httpx.AsyncBaseTransport | None = None
                          ) -> tuple[list[RequestRecord], dict]:
    """Drives `loop`'s sessions against the server, closed-loop, in client time.

    Each arrival is sent at its time (the response end of the previous request plus think time,
    `ClosedLoop`) as `prompt(request)`: the request as the server sees it (same id and arrival,
    e.g. from `eval.live.prompts.scaled_requests`) and its token ids; its response makes the
    next arrivals. The
    run is bounded: arrivals due after `deadline_s` seconds, or beyond `max_requests` sent
    (0 = no count bound), are not sent. `backend`, `model`, `max_tokens`, `transport`: as
    `replay`.

    Returns:
      The records of the requests sent, in completion order, and the state as `replay`'s plus
      `unsent_requests` (requests of the started sessions not sent because of the bounds: the
      dropped arrival and everything its session would have sent after it).

    Raises:
      As `replay`.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records: list[RequestRecord] = []
    lags: list[float] = []
    server_ttft: dict = {}
    outputs: dict = {}
    post = _poster(backend, headers, server_ttft, outputs, model, max_tokens)
    sent = 0
    async with _client(url, timeout, transport) as client:
        t0 = time.perf_counter()
        tasks: set[asyncio.Task] = set()

        def schedule(arrivals: list[tuple[float, Request]]) -> None:
            nonlocal sent
            for t, request in arrivals:
                if t > deadline_s or (max_requests and sent >= max_requests):
                    continue  # its session stops here: the rest of it is never made
                sent += 1
                task = asyncio.ensure_future(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        async def one(request: Request) -> None:
            sent, tokens = prompt(request)
            record = await _send(client, t0, sent, tokens, lags, post)
            records.append(record)
            end = loop.response_end(record.first_token_time, record.finish_time,
                                    record.request.output_len)
            schedule(loop.on_end(request.request_id, end))

        schedule(loop.start())
        while tasks:
            await asyncio.gather(*list(tasks))
        state = await _finish(client, backend, headers, t0, lags, server_ttft, outputs)
    state["unsent_requests"] = loop.total_requests() - sent
    return records, state


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None,
                 headers: dict | None = None) -> None:
    """Polls `url/health` until 200; raises RuntimeError if the server exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was "
                               "healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", headers=headers, timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not healthy within {timeout:.0f} s")


class PoolState(NamedTuple):
    """What `GET /v1/workers` says about the pool at one moment."""

    finished: int  # splits and merges finished
    in_progress: int  # splits and merges in progress
    composition: list[int]  # CP degrees in device order
    executables: int  # prefill executables the workers have created (0 if not reported)


def pool_state(url: str, headers: dict | None = None) -> PoolState:
    """The pool's `PoolState`, from one `GET url/v1/workers`.

    Raises:
      httpx.HTTPError: the server did not answer, or answered with an error status.
    """
    r = httpx.get(f"{url}/v1/workers", headers=headers, timeout=10.0)
    r.raise_for_status()
    info = r.json()
    return PoolState(info.get("reconfigurations_total", len(info["reconfigurations"])),
                     len(info["reconfigurations_in_progress"]),
                     info["composition"],
                     sum(int(w.get("prefill_executables", 0)) for w in info["workers"]))


def pool_changes(url: str, headers: dict | None = None) -> tuple[int, int, list[int]]:
    """`(finished splits and merges, those in progress, composition)` (`pool_state`)."""
    return pool_state(url, headers)[:3]


def compiled_executables(url: str, headers: dict | None = None) -> int:
    """Prefill executables the server's workers have created so far (`pool_state`)."""
    return pool_state(url, headers).executables


@contextlib.contextmanager
def launched_server(server_flags: str, url: str, headers: dict | None = None,
                    timeout: float = 300.0, log: IO | None = None, new_session: bool = False,
                    env: dict[str, str] | None = None):
    """Runs `python -m serving.main <server_flags>` for the duration of the block; yields the
    `subprocess.Popen` (its `returncode` is the exit status after the block). With `log` (a
    file open for writing) the server's stdout and stderr go there; with `new_session` it runs
    in its own session, so a Ctrl-C at the terminal reaches only the caller, which stops the
    server (SIGTERM) when it leaves the block. `env` adds environment variables (e.g. a key
    as `VERTUMNUS_ADMIN_API_KEY`, which `ps` does not show as it shows flags)."""
    cmd = [sys.executable, "-m", "serving.main", *shlex.split(server_flags)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None,
                            start_new_session=new_session,
                            env={**os.environ, **env} if env else None)
    try:
        wait_healthy(url, timeout, proc, headers)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
