"""The soak test against a live server: a steady request stream while the pool splits and merges.

`run_soak` (the logic of `python -m eval.soak`) launches `python -m serving.main` with its own
controller off and an admin key (or uses a running server), then runs together, on one asyncio
loop:

- the request stream: `concurrency` closed-loop senders (optionally capped at `rate` requests/s
  in total), each request with a unique client id (in the body's `user` field and the
  `X-Request-Id` header); a share `repeat_fraction` of them are one of `repeated_prompts` fixed
  prompts, the others unique random prompts, with lengths drawn from the range
  `prompt_lengths` (few padded lengths, so the prefill executables compile early); a share
  `disconnect_fraction` is abandoned once the server reads it (`soak_server.abandon`). Every
  request is accounted for client-side (`eval.live.soak_ledger.Ledger`), and the greedy first
  token of each repeated prompt is checked across the workers and CP degrees that served it
  (`FirstTokens`);
- the reconfiguration driver: every `interval_s` a legal split or merge (in the order `walk`:
  `next_kind`, `choose_operation`) through the admin API, waited for until `GET /v1/workers`
  lists it as finished, until `operations` have finished (or `max_duration_s` passed);
- an RSS sampler of the server process (`/proc/<pid>/status`, every `rss_interval_s`) and a
  progress line every `progress_interval_s`.

The server's request counters (`GET /metrics`) are read before the first request and, once the
stream stopped, every request in flight was waited for and the pool is idle (`settle`), again:
`soak_server.check_counts` holds them against the client's ledger. Then the server is stopped
with SIGTERM. The result (`eval.live.soak_report` prints and judges it) is written as JSON.
The server must serve the soak alone (its counters would count other clients' requests).

The parts: `soak_config` (`SoakConfig`, the prompts, RSS), `soak_run` (the coroutines),
`soak_ledger` (the pure accounting), `soak_server` (the server-side counters, abandoned
requests), `soak_ops` (which split or merge next), `soak_report` (result, verdict, table); here
the run as a whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

import httpx

from eval.live.client import launched_server
from eval.live.soak_config import PromptSet, SoakConfig
from eval.live.soak_report import assemble, failures, server_log_errors, verdict
from eval.live.soak_run import SoakRun
from eval.live.soak_server import check_counts, pool_idle

SETTLE_S = 60.0  # seconds the end waits for an idle pool and the counters to catch up


async def settle(run: SoakRun, timeout_s: float = SETTLE_S) -> dict | None:
    """After the stream stopped: waits (at most `timeout_s` seconds) until `GET /v1/workers`
    shows an idle pool (abandoned requests may still run unseen) and the server's counters
    account for every answered, refused and abandoned request, then returns the last
    `GET /metrics` counts (None when it never answered)."""
    s = run.ledger.summary()
    expected = s["answered"] + s["refused"] + s["abandoned"]
    end, deadline = None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pool_idle(await run.workers()):
            end = await run.metrics()
            if end is not None and sum(end[k] - run.metrics_start[k] for k in
                                       ("success", "failure", "aborted", "rejected")) >= expected:
                return end
        await asyncio.sleep(0.2)
    return end if end is not None else await run.metrics()


async def soak(cfg: SoakConfig) -> dict:
    """Runs the soak against the server at `cfg.url` (healthy, its controller off) and returns
    the result (`eval.live.soak_report.assemble`)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 8,
                          max_keepalive_connections=cfg.concurrency + 8)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=timeout, limits=limits) as client:
        info = (await client.get("/v1/models", headers=headers)).json()["data"][0]
        prompts = PromptSet(int(info["vocab_size"]), [min(n, int(info["max_model_len"]))
                                                      for n in cfg.prompt_lengths],
                            cfg.repeated_prompts, cfg.repeat_fraction, cfg.seed,
                            cfg.disconnect_fraction)
        run = SoakRun(cfg, client, prompts)
        start_state = await run.workers()
        run.metrics_start = await run.metrics()
        run.sample_rss()
        helpers = [asyncio.create_task(run.sample()), asyncio.create_task(run.progress())]
        senders = [asyncio.create_task(run.stream()) for _ in range(cfg.concurrency)]
        try:
            reason = await run.drive()
        except asyncio.CancelledError:  # Ctrl-C: stop, but account for what was sent
            asyncio.current_task().uncancel()
            reason = "interrupted"
        finally:
            run.stop.set()
        drain_start = time.monotonic()
        await asyncio.gather(*senders)  # each finishes the request it has in flight
        drain_s = time.monotonic() - drain_start
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        end = await settle(run) if run.metrics_start is not None else None
        counts = check_counts(run.metrics_start, end, run.ledger.summary())
        run.sample_rss()
        end_state = await run.workers()
    return assemble(run, reason, start_state, end_state, drain_s, counts)


def run_soak(cfg: SoakConfig, server_flags: str | None, out_dir: str) -> tuple[dict, str]:
    """`soak`, first launching `python -m serving.main <server_flags>` (its output in
    `<out_dir>/soak-<time>.server.log`, its pid the RSS sampled) unless `server_flags` is None
    (a running server at `cfg.url`); adds `failures`, `verdict` and `passed` to the result and
    writes it to `<out_dir>/soak-<time>.json`.

    Returns:
      The result and the path of its JSON.
    """
    os.makedirs(out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(out_dir, f"soak-{stamp}.json")
    if server_flags is None:
        result = asyncio.run(soak(cfg))
    else:
        log_path = os.path.join(out_dir, f"soak-{stamp}.server.log")
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        print(f"starting python -m serving.main {server_flags} (log: {log_path})", flush=True)
        keys = {"VERTUMNUS_ADMIN_API_KEY": cfg.admin_api_key}  # not in `ps`, as flags would be
        if cfg.api_key:
            keys["VERTUMNUS_API_KEY"] = cfg.api_key
        with open(log_path, "w") as log:
            with launched_server(server_flags, cfg.url, headers, timeout=600.0, log=log,
                                 new_session=True, env=keys) as proc:
                result = asyncio.run(soak(dataclasses.replace(cfg, server_pid=proc.pid)))
                print(f"stopping the server (SIGTERM) after {result['wall_s']:.0f} s", flush=True)
        result.update(server_exit_status=proc.returncode, server_log=log_path,
                      server_log_errors=server_log_errors(log_path))
    result["failures"] = failures(result)
    result["verdict"] = verdict(result)  # passed / failed / incomplete / interrupted
    result["passed"] = result["verdict"] == "passed"
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True, allow_nan=False)
    return result, path
