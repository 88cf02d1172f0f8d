"""Load generator: replays a trace or the built-in workload against a running server over HTTP.

    python -m eval.live.loadgen --launch_server               # start, replay, report, stop (README)
    python -m eval.live.loadgen --url=http://127.0.0.1:8000 --trace=../shared/traces/... --duration=60
    python -m eval.live.loadgen --backend=openai --url=http://127.0.0.1:8000 --model=Qwen/Qwen3-8B

Each request is sent at its arrival time (open loop, asyncio + httpx; a late send is logged in
the result as `max_send_lag_s`), with a prompt built by `eval.live.prompts` (block hashes ->
deterministic token blocks, lengths scaled by `--tokens_per_block / trace block size`, ids in
`[0, vocab size)`, cut to `--max_prompt_len`). TTFT is measured at the client, from send to
the response (to the first streamed token with `--backend=openai`). The JSON and the table are
`eval.replay`'s (`eval.metrics.summarize` keys, `eval.report.markdown_table`) plus
`vllm bench serve`'s (below), plus, with our backend, the server's composition changes from
`GET /v1/workers`.

`--backend` picks the server. `vertumnus` (default): this project's (`python -m serving.main`),
whose `/v1/models` gives the vocabulary, block size and `max_model_len`, whose answers name
worker, CP degree and server timings, with the warm-up and the pool reports below. `openai`:
any OpenAI-compatible `/v1/completions` (vLLM, SGLang): prompts are sent as token-id lists with
`--max_tokens` (default 1), `stream: true` and `stream_options.include_usage`, and TTFT is the
time from sending to the first SSE chunk carrying a token (`eval.live.openai_stream`, as `vllm
bench serve`); `--model` (default: the first of `/v1/models`) is sent as `model`; the
vocabulary size is `--vocab_size`, else the `/v1/models` entry's `vocab_size` when the server
reports one (vLLM and SGLang do not: then the run stops with an error naming `--vocab_size`);
prompts are cut to the server's `max_model_len` less `--max_tokens` when it reports one. No
warm-up, no `/v1/workers`; `--launch_server` is refused. `--api_key` (else the environment's
`OPENAI_API_KEY`, for `openai` only) is sent as `Authorization: Bearer`. A failed request (HTTP
status, connection error, timeout, a stream without a token) is counted with its reason, never
ends the run.

Result JSON (`--output_dir`/`<backend>-<model>-<workload>-<YYYYmmdd-HHMMSS>.json`, or
`--result_filename`; an existing file is never replaced: `-1`, `-2`, ... is appended, and an
existing `--result_filename` is refused before the run). Keys:
- `vllm bench serve`'s (`eval.live.bench_result`): `date`, `backend`, `endpoint_type`, `label`
  (None), `model_id`, `tokenizer_id` (None: prompts are token ids), `num_prompts` (requests
  sent), `request_rate` (offered, req/s), `burstiness` and `max_concurrency` (None: arrivals
  come from the workload, unbounded), `duration` (s), `completed`, `failed`,
  `total_input_tokens`, `total_output_tokens`, `request_throughput` (req/s), `output_throughput`
  and `total_token_throughput` (tok/s), per request `input_lens`, `output_lens`, `ttfts` (s),
  `itls` (s), `latencies` (s), `start_times` (s), `generated_texts`, `errors`, and `mean_`,
  `median_`, `std_` and `p<P>_<m>_ms` (ms) for each metric of `--percentile_metrics` and
  percentile of `--metric_percentiles`; TTFT statistics are over `ttfts` (from the send);
- the loadgen's own: `eval.metrics.summarize`'s (`slo_attainment` etc., TTFT counted from the
  scheduled arrival; with `openai` the server-side `gpu_seconds`, `mean_queue_ms`,
  `mean_prefill_ms` are None, and the cache keys too unless the server reports cached tokens),
  `system`, `trace`, `max_send_lag_s`, `tokens_per_block`; with our backend `policy` (name,
  description and router class, from `GET /v1/workers`), `composition`,
  `reconfigurations`, `warmup_reconfigurations`, `measured_executables_created`,
  `mean_server_ttft_ms`; closed-loop runs `replay`, `session_rate`, `sessions_started`,
  `unsent_requests`, `tpot_ms`, `max_think_time_s`;
- `settings`: every flag of this tool (`api_key` redacted).

With our backend, before the measured run, unmeasured warm-up rounds of the
built-in workload (`--warmup_duration` each, a new seed per round) repeat until no split or
merge has started or finished and no prefill executable was compiled for `--settle_quiet_s` of
warm-up (at most `--warmup_rounds`; `prefill_executables` of `GET /v1/workers`), so the
measurement sees the pool the load settles it to, with the prefill executables the warm-up met
compiled (on a machine whose compilation cache is empty, a shape first met in the measured
window still compiles there and stalls its worker for seconds: the result JSON counts them,
`measured_executables_created`);
the splits and merges of the warm-up and of the measured run are reported apart.

Agent sessions (`--trace=<folder of session files>`, e.g. ../shared/traces/agent_sessions) are
replayed closed-loop, as in the simulator (`eval.traces.closed_loop`): session instances start as
a Poisson process at `--session_rate` sessions/s during `--duration` seconds, and each request is
sent `think_time` (capped at `--max_think_time_s`) after the previous response ended, that
response ending `output_len x --tpot_ms` after its first token. The run is bounded: nothing is
sent after `--deadline_s` (default twice `--duration`) or beyond `--max_requests`; the result
counts what was left unsent (`unsent_requests`).

With `--launch_server` the binary `python -m serving.main` is started as a child process with
`--server_flags`, waited for on `/health`, and stopped with SIGTERM at the end (it finishes its
in-flight prefills and exits 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time

from absl import app, flags

from eval import report
from eval.live.bench_result import (PERCENTILE_METRICS, parse_metrics, parse_percentiles,
                                    result_filename, vllm_metrics, write_new)
from eval.live.client import (BACKENDS, launched_server, pool_state, replay, replay_sessions,
                              workload)
from eval.live.openai_stream import model_entry, vocab_size
from eval.live.prompts import PromptScale, scaled_requests
from eval.metrics import summarize
from eval.traces.closed_loop import ClosedLoop, session_starts
from eval.traces.loaders import TRACE_FORMATS
from eval.traces.sessions import SessionWorkload

_BACKEND = flags.DEFINE_enum("backend", "vertumnus", list(BACKENDS), "Server kind: this "
                             "project's (`vertumnus`) or any OpenAI-compatible one (`openai`).")
_MODEL = flags.DEFINE_string("model", None, "Model name sent in each request and recorded as "
                             "model_id; default the first model of /v1/models.")
_VOCAB = flags.DEFINE_integer("vocab_size", None, "Prompt token ids are drawn from [0, this); "
                              "default the vocab_size of /v1/models (needed when the server "
                              "does not report one, as vLLM and SGLang).", lower_bound=2)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 1, "Tokens generated per request (our server "
                                   "takes only 1).", lower_bound=1)
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_len", 0, "Cut prompts to this many tokens; 0 = "
                                   "the server's max_model_len (less --max_tokens with openai), "
                                   "4096 when it reports none.", lower_bound=0)
_RESULT_FILE = flags.DEFINE_string("result_filename", None, "Name of the result JSON in "
                                   "--output_dir; default <backend>-<model>-<workload>-<date>.json."
                                   " Never overwritten.")
_PERCENTILES = flags.DEFINE_string("metric_percentiles", "90,99", "Comma-separated percentiles "
                                   "in (0, 100] of the p<P>_<metric>_ms keys.")
_PCT_METRICS = flags.DEFINE_string("percentile_metrics", ",".join(PERCENTILE_METRICS),
                                   "Comma-separated metrics with statistics: a subset of "
                                   f"{','.join(PERCENTILE_METRICS)} (ttft always).")
_URL = flags.DEFINE_string("url", None, "Server base URL; default http://127.0.0.1:<--port>.")
_PORT = flags.DEFINE_integer("port", 8000, "Port of the server (launched or running).",
                             lower_bound=1, upper_bound=65535)
_LAUNCH = flags.DEFINE_bool("launch_server", False, "Start `python -m serving.main --port=<--port> "
                            "<--server_flags>` for the run and stop it afterwards.")
_SERVER_FLAGS = flags.DEFINE_string(
    "server_flags", "--log_level=warning",
    "Flags of the launched server (default: the binary's own defaults, quieter). They replace "
    "the default, so keep --log_level=warning in them for a quiet run: e.g. "
    "'--composition=2,2,2,2 --policy=vertumnus-paper --log_level=warning' shows the paper's "
    "controller merging four CP-2 workers under this light load.")
_TRACE = flags.DEFINE_string("trace", "", "Trace file (as eval.replay); empty = the built-in "
                             "Tool-Agent workload.")
_FORMAT = flags.DEFINE_enum("trace_format", "auto", ["auto", *TRACE_FORMATS],
                            "Trace format (a folder is agent sessions).")
_SESSION_RATE = flags.DEFINE_float("session_rate", 0.5, "Agent sessions: session starts per "
                                   "second during --duration.", lower_bound=1e-6)
_TPOT = flags.DEFINE_float("tpot_ms", 30.0, "Agent sessions: decode ms per output token (when a "
                           "response ends; eval.replay_config says why 30).", lower_bound=0.0)
_MAX_THINK = flags.DEFINE_float("max_think_time_s", 60.0, "Agent sessions: think times are capped "
                                "here (the source replayer's --max-delay).", lower_bound=0.0)
_DEADLINE = flags.DEFINE_float("deadline_s", 0.0, "Agent sessions: send nothing after this many "
                               "seconds (0 = twice --duration).", lower_bound=0.0)
_DURATION = flags.DEFINE_float("duration", 30.0, "Seconds of workload to replay (a seeded window "
                               "of a trace; the start of the built-in workload).", lower_bound=0.1)
_RATE = flags.DEFINE_float("rate", 0.0, "Re-time the requests to this rate (req/s); 0 = keep.",
                           lower_bound=0.0)
_TOKENS_PER_BLOCK = flags.DEFINE_integer("tokens_per_block", 16, "Prompt tokens per trace block "
                                         "(length scale = this / trace block size).",
                                         lower_bound=1)
_TRACE_BLOCK = flags.DEFINE_integer("trace_block_size", 512, "Tokens per block of the trace.",
                                    lower_bound=1)
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 0, "Send at most this many (0 = all).",
                                     lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the workload and window.")
_SLO_MS = flags.DEFINE_float("slo_ms", 500.0, "TTFT SLO of every request (ms) for the SLO "
                             "attainment columns; 0 = none.", lower_bound=0.0)
_WARMUP = flags.DEFINE_float("warmup_duration", 20.0, "Seconds of one unmeasured warm-up round "
                             "(the built-in workload, a new seed each round): compiles the "
                             "prefill executables the measured run needs; 0 = no warm-up.",
                             lower_bound=0.0)
_WARMUP_ROUNDS = flags.DEFINE_integer(
    "warmup_rounds", 6, "Repeat warm-up rounds until no split or merge has started or finished "
    "and no prefill executable was compiled for --settle_quiet_s of warm-up, at most this many "
    "rounds: the measured run then sees the pool the load settles it to, with the executables "
    "the warm-up met compiled.", lower_bound=1)
_SETTLE_QUIET = flags.DEFINE_float(
    "settle_quiet_s", 20.0, "Warm-up time with no split, merge or compilation after which the "
    "pool counts as settled (seconds, counted in whole --warmup_duration rounds). The default, "
    "one quiet round, can take a controller that has not acted yet for a settled pool: the "
    "default what-if controller evaluates every 30 s (interval_s; sooner when a backlog "
    "outgrows its plan) and waits 60 s after a change (cooldown_s); 90 or more waits out both, "
    "at the cost of more rounds (each new seed meets a few new prefill shapes, so long quiets "
    "often end at --warmup_rounds). The paper's controller waits hold_s + cooldown_s, "
    "10 + 10 s.", lower_bound=0.0)
_API_KEY = flags.DEFINE_string("api_key", None, "Bearer key of the server (openai: default "
                               "$OPENAI_API_KEY).")
_TIMEOUT = flags.DEFINE_float("timeout", 600.0, "Per-request HTTP timeout (seconds).",
                              lower_bound=1e-3)
_OUT = flags.DEFINE_string("output_dir", "out/loadgen", "Where JSON and table go.")


def _warm_up(url: str, headers: dict | None, scale: PromptScale, block: int,
             api_key: str | None) -> None:
    """Our backend: unmeasured warm-up rounds until the pool settles (module doc)."""
    quiet = 0.0  # warm-up seconds since a split, a merge or a compilation was last seen
    for k in range(_WARMUP_ROUNDS.value if _WARMUP.value > 0 else 0):
        warm, _ = workload("", "auto", _WARMUP.value, _RATE.value, _SEED.value + 1 + k,
                           _TRACE_BLOCK.value)
        before = pool_state(url, headers)
        asyncio.run(replay(url, scaled_requests(warm, scale, block), api_key, _TIMEOUT.value,
                           model=_MODEL.value, max_tokens=_MAX_TOKENS.value))
        after = pool_state(url, headers)
        new_executables = after.executables - before.executables
        same_pool = (after.finished, after.in_progress) == (before.finished, 0) and not \
            before.in_progress
        settled = same_pool and new_executables <= 0
        quiet = quiet + _WARMUP.value if settled else 0.0
        # (a split or merge replaces workers, whose counts start again: no count then)
        created = f"{new_executables}" if same_pool else "n/a (the pool changed)"
        print(f"warm-up {k + 1}: {len(warm)} requests over {_WARMUP.value:.0f} s (not "
              f"measured), composition {after.composition}, prefill executables created: {created}")
        if quiet >= _SETTLE_QUIET.value and quiet > 0:
            return  # no split or merge for long enough: settled
    if _WARMUP.value > 0:
        print(f"the pool was still changing (or compiling) after {_WARMUP_ROUNDS.value} "
              "warm-up rounds")


def _print_pool(result: dict, composition: list[int]) -> None:
    """Our backend: the policy, the composition changes and the measured compilations."""
    print()
    policy = result.get("policy")
    if policy:  # (a server before `policy` was listed in /v1/workers: not printed)
        print(f"policy: {policy['name']} ({policy['description']}; router {policy['router']})")
    print(f"composition at the end: {composition}")
    for title, key in (("during the warm-up", "warmup_reconfigurations"),
                       ("during the measured run", "reconfigurations")):
        print(f"splits and merges {title}:" + ("" if result[key] else " none"))
        for r in result[key]:
            print(f"  epoch {r['epoch']}: {r['kind']} {r['old']} -> {r['new']} ({r['origin']}) "
                  f"at {r['finished']:.1f} s (drained in {r['drained'] - r['started']:.2f} s) "
                  f"-> {r['composition']}")
    created = result["measured_executables_created"]
    print("prefill executables created during the measured run: " + (
        "n/a (the pool changed)" if created is None else f"{created}" + (
            " (each compiled while requests waited, unless the compilation cache had it)"
            if created else "")))


def _settings() -> dict:
    """Every flag of this tool by name, `api_key` redacted."""
    holders = [v for v in globals().values() if isinstance(v, flags.FlagHolder)]
    out = {h.name: h.value for h in holders}
    if out.get("api_key"):
        out["api_key"] = "<redacted>"
    return dict(sorted(out.items()))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    openai = _BACKEND.value == "openai"
    if openai and _LAUNCH.value:
        sys.exit("error: --launch_server starts this project's server (python -m serving.main) "
                 "and needs --backend=vertumnus; with --backend=openai start the server yourself "
                 "and pass its --url")
    try:
        percentiles = parse_percentiles(_PERCENTILES.value)
        metrics = list(dict.fromkeys(["ttft", *parse_metrics(_PCT_METRICS.value)]))
        reqs, name = workload(_TRACE.value, _FORMAT.value, _DURATION.value, _RATE.value,
                              _SEED.value, _TRACE_BLOCK.value)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    if _RESULT_FILE.value and os.path.exists(os.path.join(_OUT.value, _RESULT_FILE.value)):
        sys.exit(f"error: --result_filename: {os.path.join(_OUT.value, _RESULT_FILE.value)} "
                 "exists; results are never overwritten (choose another name)")
    if not (math.isfinite(_WARMUP.value) and math.isfinite(_SETTLE_QUIET.value)):
        sys.exit(f"error: --warmup_duration and --settle_quiet_s must be finite seconds, got "
                 f"{_WARMUP.value} and {_SETTLE_QUIET.value}")
    sessions = reqs if isinstance(reqs, SessionWorkload) else None
    if sessions is not None:
        for flag in (_SESSION_RATE, _TPOT, _MAX_THINK, _DEADLINE):
            if not math.isfinite(flag.value):
                sys.exit(f"error: --{flag.name} must be a finite number, got {flag.value}")
        loop = ClosedLoop(sessions.with_requests(
            [dataclasses.replace(r, ttft_slo=_SLO_MS.value / 1e3 if _SLO_MS.value > 0 else None)
             for r in sessions.requests]),
            session_starts(sessions, _SESSION_RATE.value, _DURATION.value, _SEED.value),
            _TPOT.value / 1e3, _MAX_THINK.value)
        reqs = []
    if _MAX_REQUESTS.value:
        reqs = reqs[:_MAX_REQUESTS.value]
    if _SLO_MS.value > 0:
        reqs = [dataclasses.replace(r, ttft_slo=_SLO_MS.value / 1e3) for r in reqs]
    if not reqs and sessions is None:
        sys.exit(f"error: the workload {name!r} has no requests in {_DURATION.value} s")
    api_key = _API_KEY.value or (os.environ.get("OPENAI_API_KEY") if openai else None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    url = (_URL.value or f"http://127.0.0.1:{_PORT.value}").rstrip("/")
    url = url.removesuffix("/v1")  # an OpenAI base URL (".../v1") names the same server
    ctx = (launched_server(f"--port={_PORT.value} {_SERVER_FLAGS.value}", url, headers)
           if _LAUNCH.value else contextlib.nullcontext())
    with ctx:
        try:
            info = model_entry(url, headers, _MODEL.value)
            vocab = vocab_size(_VOCAB.value, info)
        except ValueError as e:
            sys.exit(f"error: {e}")
        block = int(info.get("block_size") or 16)
        max_len = _MAX_PROMPT.value or max(1, int(info.get("max_model_len") or 4096) - (
            _MAX_TOKENS.value if openai and info.get("max_model_len") else 0))
        scale = PromptScale(_TOKENS_PER_BLOCK.value, vocab, max_len)
        pairs = scaled_requests(reqs, scale, block) if reqs else []
        opts = dict(backend=_BACKEND.value, max_tokens=_MAX_TOKENS.value,
                    model=info["id"] if openai else _MODEL.value)
        if not openai:
            _warm_up(url, headers, scale, block, api_key)
            start = pool_state(url, headers)
        if sessions is None:
            print(f"{name}: sending {len(pairs)} requests over {reqs[-1].arrival_time:.1f} s, "
                  f"mean prompt {sum(len(p) for _, p in pairs) / len(pairs):.0f} tokens, to {url}")
            records, state = asyncio.run(replay(url, pairs, api_key, _TIMEOUT.value, **opts))
            rate = len(reqs) / max(reqs[-1].arrival_time, 1e-9)
        else:
            deadline = _DEADLINE.value or 2 * _DURATION.value
            print(f"{name}: {len(loop.starts)} session instances starting over "
                  f"{_DURATION.value:.0f} s, closed-loop, nothing sent after {deadline:.0f} s, "
                  f"to {url}")
            records, state = asyncio.run(replay_sessions(
                url, loop, lambda r: scaled_requests([r], scale, block)[0], deadline,
                _MAX_REQUESTS.value, api_key, _TIMEOUT.value, **opts))
            rate = len(records) / max(deadline, 1e-9)
        if not openai:
            measured_compiled = pool_state(url, headers).executables - start.executables
    result = summarize(records)
    for key in [k for k in result if k.endswith("_ttft_ms")]:
        del result[key]  # TTFT statistics are vLLM's (below), over `ttfts`
    if sessions is not None:
        result.update(replay="closed-loop", session_rate=_SESSION_RATE.value,
                      sessions_started=len(loop.starts), unsent_requests=state["unsent_requests"],
                      tpot_ms=_TPOT.value, max_think_time_s=_MAX_THINK.value)
    result.update(system=f"{'openai' if openai else 'live'}:{info['id']}", trace=name,
                  request_rate=rate, max_send_lag_s=state["max_send_lag_s"],
                  tokens_per_block=_TOKENS_PER_BLOCK.value)
    outputs = state["outputs"]
    if openai:  # what only our server tells: unknown here
        result.update(gpu_seconds=None, mean_queue_ms=None, mean_prefill_ms=None)
        if all(o.cached_tokens is None for o in outputs):
            result.update(total_cached_tokens=None, prefix_hit_rate=None)
    else:
        # the server lists its latest finished changes (`reconfigurations_total` counts all)
        recs = state["reconfigurations"]
        total = state.get("reconfigurations_total", len(recs))
        split = max(0, start.finished - (total - len(recs)))
        result.update(
            policy=state.get("policy"), composition=state["composition"],
            warmup_reconfigurations=recs[:split],
            # executables the measured window had to create (each one stalled its worker on a
            # cold compilation cache); None when a split or merge changed the workers meanwhile
            measured_executables_created=(measured_compiled if total == start.finished else None),
            reconfigurations=recs[split:],
            mean_server_ttft_ms=1e3 * sum(state["server_ttft_s"].values()) / max(
                1, len(state["server_ttft_s"])))
    result.update(vllm_metrics(outputs, state["duration_s"], percentiles, metrics))
    now = time.time()
    result.update(date=time.strftime("%Y%m%d-%H%M%S", time.localtime(now)),
                  backend=_BACKEND.value, endpoint_type=_BACKEND.value, label=None,
                  model_id=info["id"], tokenizer_id=None, num_prompts=len(outputs),
                  burstiness=None, max_concurrency=None, settings=_settings())
    wanted = os.path.join(_OUT.value, _RESULT_FILE.value or result_filename(
        _BACKEND.value, info["id"], name, now))
    path = write_new(wanted, result)
    print(report.markdown_table([result]))
    if not openai:
        _print_pool(result, state["composition"])
    if result["failed"]:
        print(f"warning: {result['failed']} requests failed: {result['failure_reasons']}")
    if path != wanted:
        print(f"warning: {wanted} exists (written meanwhile); not replaced")
    print(f"results in {path}")
    if outputs and not any(o.success for o in outputs):
        sys.exit(f"error: all {len(outputs)} requests failed (see {path})")


if __name__ == "__main__":
    app.run(main)
