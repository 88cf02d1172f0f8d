"""HTTP client side of live runs: the workload to send, the open-loop replay, the server process.

Used by `eval.live.loadgen` (the CLI) and `eval.live.fidelity`. `replay` sends each request at its arrival
time (asyncio + httpx) and turns each response into a `serving.policy.scheduler.RequestRecord` with
client-side times, so `eval.metrics.summarize` reads live runs exactly as simulated ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import httpx

from eval.traces.loaders import load_trace, sample_window
from eval.traces.workloads import scale_to_rate, tool_agent_workload
from serving.policy.request import Request
from serving.policy.request import RequestRecord


def workload(trace: str, fmt: str, duration: float, rate: float, seed: int,
             trace_block_size: int) -> tuple[list[Request], str]:
    """The requests to send (arrival times from 0) and the workload's name."""
    if not trace:
        reqs = tool_agent_workload(duration_s=duration, seed=seed, block_size=trace_block_size)
        name = "toolagent"
    else:
        t = load_trace(trace, fmt=fmt, block_size=trace_block_size, rate=rate or 1.0, seed=seed)
        reqs, name = sample_window(t.requests, duration, seed), t.name
    if rate > 0 and reqs:
        reqs = scale_to_rate(reqs, rate)
    return reqs, name


async def _send(client: httpx.AsyncClient, t0: float, request: Request, tokens: list[int],
                headers: dict, lags: list[float], server_ttft: dict) -> RequestRecord:
    delay = t0 + request.arrival_time - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter() - t0
    lags.append(max(0.0, sent - request.arrival_time))
    try:
        resp = await client.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1},
                                 headers=headers)
        body = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        return RequestRecord(request, finish_time=time.perf_counter() - t0,
                             error=f"{type(e).__name__}: {e}")
    done = time.perf_counter() - t0
    if resp.status_code != 200:
        msg = body.get("error", {}).get("message", resp.text) if isinstance(body, dict) else resp.text
        return RequestRecord(request, finish_time=done, error=f"HTTP {resp.status_code}: {msg}")
    tm = body["timings"]
    server_ttft[request.request_id] = tm["ttft_seconds"]
    start = sent + tm["queue_seconds"]
    return RequestRecord(
        request, body["worker_id"], body["cp_degree"], body["epoch"], start,
        start + tm["prefill_seconds"], done,
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
        first_token=body["choices"][0]["token_ids"][0])


async def replay(url: str, pairs: list[tuple[Request, list[int]]], api_key: str | None = None,
                 timeout: float = 600.0) -> tuple[list[RequestRecord], dict]:
    """Sends every (request, prompt) at its arrival time.

    Returns:
      The records (client-side times: sent at `arrival_time`, first token when the response
      arrived), in `pairs` order, and the server's `/v1/workers` state after the last answer
      plus `max_send_lag_s` (latest send behind schedule, seconds) and `server_ttft_s`
      (request id -> TTFT the server measured, seconds, for completed requests).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        lags: list[float] = []
        server_ttft: dict = {}
        t0 = time.perf_counter()
        records = await asyncio.gather(*(_send(client, t0, r, p, headers, lags, server_ttft)
                                         for r, p in pairs))
        state = (await client.get("/v1/workers", headers=headers)).json()
    state["max_send_lag_s"] = max(lags, default=0.0)
    state["server_ttft_s"] = server_ttft
    return list(records), state


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
    return PoolState(len(info["reconfigurations"]), len(info["reconfigurations_in_progress"]),
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
                    timeout: float = 300.0):
    """Runs `python -m serving.main <server_flags>` for the duration of the block."""
    cmd = [sys.executable, "-m", "serving.main", *shlex.split(server_flags)]
    proc = subprocess.Popen(cmd)
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
