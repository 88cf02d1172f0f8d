"""The soak test against a live server: a steady request stream while the pool splits and merges.

`run_soak` (the logic of `python -m eval.soak`) launches `python -m serving.main` with its own
controller off and an admin key (or uses a running server), then runs together, on one asyncio
loop:

- the request stream: `concurrency` closed-loop senders (optionally capped at `rate` requests/s
  in total), each request with a unique client id (in the body's `user` field and the
  `X-Request-Id` header); a share `repeat_fraction` of them are one of `repeated_prompts` fixed
  prompts, the others unique random prompts, with lengths from `prompt_lengths` (a few lengths,
  so the prefill executables compile early). Every request is accounted for client-side
  (`eval.live.soak_ledger.Ledger`), and the greedy first token of each repeated prompt is
  checked across the workers and CP degrees that served it (`FirstTokens`);
- the reconfiguration driver: every `interval_s` a legal split or merge (in the order `walk`:
  `next_kind`, `choose_operation`) through the admin API, waited for until `GET /v1/workers`
  lists it as finished, until `operations` have finished (or `max_duration_s` passed);
- an RSS sampler of the server process (`/proc/<pid>/status`, every `rss_interval_s`) and a
  progress line every `progress_interval_s`.

At the end the stream stops, every request in flight is waited for, and the server is stopped
with SIGTERM. The result (`eval.live.soak_report` prints and judges it) is written as JSON.

The parts: `soak_config` (`SoakConfig`, the prompts, RSS), `soak_run` (the coroutines),
`soak_ledger` (the pure accounting), `soak_ops` (which split or merge next), `soak_report`
(result, verdict, table); here the run as a whole.
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
from eval.live.soak_report import assemble, server_log_errors
from eval.live.soak_run import SoakRun


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
                            cfg.repeated_prompts, cfg.repeat_fraction, cfg.seed)
        run = SoakRun(cfg, client, prompts)
        start_state = await run.workers()
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
        run.sample_rss()
        end_state = await run.workers()
    return assemble(run, reason, start_state, end_state, drain_s)


def run_soak(cfg: SoakConfig, server_flags: str | None, out_dir: str) -> tuple[dict, str]:
    """`soak`, first launching `python -m serving.main <server_flags>` (its output in
    `<out_dir>/soak-<time>.server.log`, its pid the RSS sampled) unless `server_flags` is None
    (a running server at `cfg.url`); writes the result to `<out_dir>/soak-<time>.json`.

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
        print(f"starting python -m serving.main {server_flags.replace(cfg.admin_api_key, '***')}"
              f" (log: {log_path})", flush=True)
        with open(log_path, "w") as log:
            with launched_server(server_flags, cfg.url, headers, timeout=600.0, log=log,
                                 new_session=True) as proc:
                result = asyncio.run(soak(dataclasses.replace(cfg, server_pid=proc.pid)))
                print(f"stopping the server (SIGTERM) after {result['wall_s']:.0f} s", flush=True)
        result.update(server_exit_status=proc.returncode, server_log=log_path,
                      server_log_errors=server_log_errors(log_path))
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True, allow_nan=False)
    return result, path
