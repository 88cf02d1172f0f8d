"""Replay a workload through simulated prefill pools: `python -m eval.replay`.

With no flags it replays the built-in Tool-Agent workload on 40 simulated H20 GPUs serving
Qwen3-30B-A3B, as homogeneous CP-2 and CP-4 pools and Vertumnus at three load levels, prints the summary
table and writes, under `--output_dir`:

- `<trace>__<system>__rate<r>.json`: one per (system, rate; r in req/s, 6 significant digits),
  `vllm bench serve` key names plus
  ours (see `eval.metrics`);
- `<trace>__summary.md` (the table) and `<trace>__summary.json` (all results);
- `<trace>.png`: mean TTFT, P90 TTFT and token-weighted SLO attainment against request rate.

Real traces: `--trace=../shared/traces/mooncake/conversation_trace.jsonl` (format from the
file: Mooncake JSONL, Azure CSV, L-Eval CSV, a folder of agent sessions; or `--trace_format`).
Agent sessions (`--trace=../shared/traces/agent_sessions`) are replayed closed-loop: sessions
start as a Poisson process and each request is sent `think_time` after the previous response
ended (`eval.traces.sessions`, `eval.offered_load`); rates then count sessions/s.
"""

from __future__ import annotations

import json
import math
import re
import os
import shutil
import sys
import tempfile
import time

from absl import app, flags

from eval import report
from eval.experiment import ReplayConfig, run_degrees, run_sweep
from eval.replay_config import parse_host_failures
from eval.sim.simulator import SimConfig
from eval.traces.loaders import TRACE_FORMATS, load_trace, sample_window
from eval.traces.sessions import SessionWorkload
from eval.traces.workloads import tool_agent_workload, workload_stats
from serving.policy.replication import SCALEOUT_GB_PER_S
from serving.policy.specs import GPUS, MODELS

_TRACE = flags.DEFINE_string("trace", "", "Trace file, or a folder of agent-session files "
                             "(replayed closed-loop); empty = the built-in Tool-Agent workload.")
_FORMAT = flags.DEFINE_enum("trace_format", "auto", ["auto", *TRACE_FORMATS],
                            "Trace format; auto = a folder is agent sessions, else from the file "
                            "suffix and CSV header.")
_TRACE_BLOCK = flags.DEFINE_integer("trace_block_size", 512, "Mooncake-format traces: tokens per "
                                    "hash_ids entry in the file (512 in Mooncake's own traces; "
                                    "16 or 64 in other public traces of that format).", lower_bound=1)
_SESSION_RATE = flags.DEFINE_float("session_rate", 0.0, "Agent sessions: base rate of session "
                                   "starts (sessions/s) that --load_factors scale; 0 = the "
                                   "pool's session capacity rate (eval.offered_load).",
                                   lower_bound=0.0)
_TPOT = flags.DEFINE_float("tpot_ms", 30.0, "Agent sessions: decode ms per output token, so a "
                           "response ends output_length x tpot_ms after its first token (why "
                           "30: eval.replay_config).", lower_bound=0.0)
_WINDOW_S = flags.DEFINE_float("session_window_s", 3600.0, "Agent sessions: session instances "
                               "start during this many seconds (each runs to its end).",
                               lower_bound=1.0)
_WARM = flags.DEFINE_float("warm_prefix_pct", 0.5, "Agent sessions: this fraction of each "
                           "session's tool + system prefix is one prefix shared by all sessions, "
                           "as production keeps it warm (the source replayer's --warm-prefix-pct "
                           "and default); 0 = sessions share nothing.", lower_bound=0.0,
                           upper_bound=1.0)
_MAX_THINK = flags.DEFINE_float("max_think_time_s", 60.0, "Agent sessions: think times are "
                                "capped here (the source replayer's --max-delay and default): a "
                                "user away longer starts a new visit.", lower_bound=0.0)
_BLOCK = flags.DEFINE_integer("block_size", 512, "Tokens per KV block (prefix-cache granularity).",
                              lower_bound=1)
_SKIP = flags.DEFINE_bool("skip_malformed", False,
                          "Skip malformed trace lines (counted and reported) instead of failing; "
                          "lines nested or longer past eval.traces.parsing's limits included.")
_LEVAL_RATE = flags.DEFINE_float("leval_rate", 2.0, "Poisson arrival rate (req/s) for the L-Eval "
                                 "CSV, which has no timestamps.", lower_bound=1e-6)
_DURATION = flags.DEFINE_float("workload_duration", 600.0,
                               "Seconds of built-in Tool-Agent workload to generate.", lower_bound=1.0)
_WINDOW = flags.DEFINE_float("window", 0.0, "If > 0, replay a seeded random window of this many "
                             "seconds of the trace instead of all of it.", lower_bound=0.0)
_SYSTEMS = flags.DEFINE_list("systems", ["homogeneous", "vertumnus"], "Systems to compare "
                             "(eval.systems; `homogeneous` = one homogeneous-cpN per --degrees "
                             "entry; plug-ins as module:attribute).")
_DEGREES = flags.DEFINE_list("degrees", ["2", "4"], "CP degrees of the run: the homogeneous "
                             "shorthand, mixed compositions, the controller's range, the SLO "
                             "reference (the largest).")
_RATES = flags.DEFINE_list("rates", [], "Request rates to sweep (req/s; `native` = the trace's own "
                           "arrival times); overrides --load_factors.")
_LOADS = flags.DEFINE_list("load_factors", ["0.8", "1.2", "1.6"],
                           "Rates as multiples of the pool's cold capacity rate (see eval.experiment); "
                           "for agent sessions, of the session capacity rate (eval.offered_load), "
                           "default 0.1,0.25,0.4 there.")
# Agent sessions hold ~100K-token contexts: the pool's KV caches, not its compute, saturate first
# (at about 0.5 of the session capacity rate on 40 H20s serving Qwen3-30B-A3B).
SESSION_LOAD_FACTORS = (0.1, 0.25, 0.4)
_GPUS = flags.DEFINE_integer("num_gpus", 40, "GPU budget of every system.", lower_bound=1)
_GPU = flags.DEFINE_enum("gpu", "h20", sorted(GPUS), "GPU of the analytic profile.")
_MODEL = flags.DEFINE_enum("model", "qwen3-30b-a3b", sorted(MODELS), "Model of the analytic "
                           "profile and the KV sizes.")
_PROFILE = flags.DEFINE_string("profile_csv", "", "Measured profile CSV instead of the analytic one.")
_SLO = flags.DEFINE_string("slo", "scale:5", "TTFT SLO: scale:K, fixed:S or affine:A,B (eval.slo).")
_NOISE = flags.DEFINE_float("noise_sigma", 0.05, "Lognormal sigma of prefill-time noise.",
                            lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the workload generator, window and noise.",
                             lower_bound=0)
_KV_BLOCKS = flags.DEFINE_integer("kv_blocks_per_gpu", 0, "KV blocks per GPU; 0 = from HBM.",
                                  lower_bound=0)
_XFER = flags.DEFINE_float("kv_transfer_gb_per_s", 50.0,
                           "KV transfer bandwidth to the decode pool (GB/s); 0 = free.", lower_bound=0)
_FIRST = flags.DEFINE_float("first_token_ms", 20.0, "Decode step that emits the first token (ms).",
                            lower_bound=0)
_PER_HOST = flags.DEFINE_integer(
    "gpus_per_host", 0, "GPUs per host: workers get hosts of this many GPUs and never span two "
    "(8 = the paper's 5 x 8 pool on 40 GPUs); 0 = every GPU on one host.", lower_bound=0)
_SCALEOUT = flags.DEFINE_float(
    "scaleout_gb_per_s", SCALEOUT_GB_PER_S, "Bandwidth of a prefix copy between workers of "
    "different hosts (GB/s; within a host copies run at 100); 0 = free. Default: one 200 Gb/s "
    "NIC.", lower_bound=0.0)
_FAIL_HOST = flags.DEFINE_multi_string(
    "fail_host", [], "Simulated host failure H@T (host H dies T seconds into each run; its "
    "queued requests are re-routed, its running ones fail) or H@T:B (it comes back at B s as "
    "new workers). Repeatable.")
_OUT = flags.DEFINE_string("output_dir", "out/replay", "Where JSON, table and plots go.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar over the sweep.")


def _floats(values, name, native=None):
    out = []
    for v in values:
        if v == "native" and native is not None:
            out.append(native)
            continue
        try:
            out.append(float(v))
        except ValueError:
            raise ValueError(f"--{name} must be a comma-separated list of numbers"
                             f"{' or native' if native is not None else ''}, got {values}") from None
    return tuple(out)


def _no_native_rate(stats: dict, trace: str) -> str:
    """Why `--rates=native` does not apply to a trace whose `workload_stats` rate is nan."""
    n = stats["count"]
    window = f" (in its --window of {_WINDOW.value:g} s)" if _WINDOW.value > 0 else ""
    has = f"has {n} arrival" if n < 2 else f"has {n} arrivals, all at the same time"
    return (f"--rates=native: the trace {trace}{window} {has}; it needs at least two arrivals "
            f"at different times to have a native rate (give --rates in req/s, or "
            f"--load_factors)")


def load_workload():
    """The requests and their label, from --trace or the built-in generator."""
    if not _TRACE.value:
        reqs = tool_agent_workload(duration_s=_DURATION.value, seed=_SEED.value,
                                   block_size=_BLOCK.value)
        name = "toolagent"
    else:
        trace = load_trace(_TRACE.value, fmt=_FORMAT.value, block_size=_BLOCK.value,
                           skip_malformed=_SKIP.value, rate=_LEVAL_RATE.value, seed=_SEED.value,
                           trace_block_size=_TRACE_BLOCK.value, warm_prefix_pct=_WARM.value)
        if trace.skipped:
            what = "session files" if isinstance(trace, SessionWorkload) else "lines"
            print(f"skipped {trace.skipped} malformed {what} of {_TRACE.value}")
        if isinstance(trace, SessionWorkload):
            if _WINDOW.value > 0:
                raise ValueError("--window does not apply to agent sessions (replayed whole, "
                                 "closed-loop); drop it")
            return trace, trace.name
        reqs, name = trace.requests, trace.name
    if _WINDOW.value > 0:
        reqs = sample_window(reqs, _WINDOW.value, _SEED.value)
    return reqs, name


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        try:
            degrees = tuple(int(d) for d in _DEGREES.value)
        except ValueError:
            raise ValueError(f"--degrees must be integers, got {_DEGREES.value}") from None
        for flag in (_FIRST, _XFER, _SCALEOUT, _NOISE, _DURATION, _WINDOW, _LEVAL_RATE, _SESSION_RATE, _TPOT,
                     _WINDOW_S, _MAX_THINK):
            if not math.isfinite(flag.value):
                raise ValueError(f"--{flag.name} must be a finite number, got {flag.value}")
        settings = dict(
            gpu=_GPU.value, model=_MODEL.value, profile_csv=_PROFILE.value or None,
            num_gpus=_GPUS.value, degrees=degrees, systems=tuple(_SYSTEMS.value),
            load_factors=_floats(_LOADS.value, "load_factors"), slo=_SLO.value,
            noise_sigma=_NOISE.value, seed=_SEED.value, kv_blocks_per_gpu=_KV_BLOCKS.value,
            sim=SimConfig(kv_transfer_gb_per_s=_XFER.value, first_token_seconds=_FIRST.value / 1e3,
                          scaleout_gb_per_s=_SCALEOUT.value, gpus_per_host=_PER_HOST.value,
                          host_failures=parse_host_failures(_FAIL_HOST.value)),
            tpot_ms=_TPOT.value, session_window_s=_WINDOW_S.value,
            max_think_time_s=_MAX_THINK.value)
        run_degrees(ReplayConfig(**settings))  # unknown systems fail before loading anything
        t0 = time.perf_counter()
        requests, name = load_workload()
        if not requests:
            raise ValueError(f"the workload {name!r} has no requests")
        sessions = isinstance(requests, SessionWorkload)
        stats = workload_stats(requests.requests if sessions else requests)
        if sessions:
            if "native" in _RATES.value:
                raise ValueError("--rates=native does not apply to agent sessions (they have no "
                                 "common clock): give sessions/s, or use --load_factors")
            if not _LOADS.present:  # agent sessions saturate the KV caches far below factor 1
                settings["load_factors"] = SESSION_LOAD_FACTORS
            rates = _floats(_RATES.value, "rates")
            if not rates and _SESSION_RATE.value > 0:
                rates = tuple(f * _SESSION_RATE.value for f in settings["load_factors"])
            print(f"workload {name}: {len(requests.roots)} sessions ({len(requests.sessions)} with "
                  f"sub-agents), {stats['count']} requests, replayed closed-loop; mean input "
                  f"{stats['input_mean']:.0f} tokens, prefix reuse with an unbounded shared cache "
                  f"{stats['reuse']:.1%}")
        else:
            if "native" in _RATES.value and not math.isfinite(stats["rate"]):
                raise ValueError(_no_native_rate(stats, _TRACE.value or name))
            rates = _floats(_RATES.value, "rates", native=stats["rate"])
            native = (f"{stats['rate']:.2f} req/s native" if math.isfinite(stats["rate"])
                      else "no native rate")
            print(f"workload {name}: {stats['count']} requests, {native}, "
                  f"mean input {stats['input_mean']:.0f} tokens, prefix reuse with an unbounded "
                  f"shared cache {stats['reuse']:.1%}")
        cfg = ReplayConfig(**settings, rates=rates)
        labels = [f"{r:.6g}" for r in cfg.rates]
        if len(set(labels)) != len(labels):
            raise ValueError(f"--rates must differ in their first 6 significant digits, got {labels}")
        results, env = run_sweep(requests, name, cfg, progress=_PROGRESS.value)
        wall = time.perf_counter() - t0
        write_outputs(results, env, cfg, name, degrees)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(report.markdown_table(results))
    for line in report.initial_choice_lines(results):
        print(line)
    for r in results:
        if r["failed"]:
            reason, n = next(iter(r["failure_reasons"].items()))
            print(f"warning: {r['system']} at {r['request_rate']:.4g} req/s failed {r['failed']} "
                  f"of {r['num_requests']} requests, e.g. ({n}x) {reason}")
    print(f"\n{len(results)} runs in {wall:.1f} s; results in {_OUT.value}/")


def write_outputs(results, env, cfg, name, degrees) -> None:
    """Writes the per-run JSON, the summaries and the plot under --output_dir (see module doc).

    Everything is written to a temporary folder beside the output folder first, then moved into
    place, so a failure leaves no half-written set of files.
    """
    extra = {"degrees": list(degrees), "window_s": _WINDOW.value, "block_size": _BLOCK.value,
             "trace_block_size": _TRACE_BLOCK.value,
             "kv_transfer_gb_per_s": _XFER.value, "first_token_ms": _FIRST.value}
    if _PER_HOST.value or _FAIL_HOST.value or _SCALEOUT.present:  # (one-host runs: as before)
        extra.update(gpus_per_host=_PER_HOST.value, scaleout_gb_per_s=_SCALEOUT.value)
    os.makedirs(_OUT.value, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".replay-", dir=_OUT.value)
    try:
        _write_all(results, env, cfg, name, extra, stage)
        for f in sorted(os.listdir(stage)):
            os.replace(os.path.join(stage, f), os.path.join(_OUT.value, f))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _write_all(results, env, cfg, name, extra, out) -> None:
    for r in results:
        r.update(extra)
        system = re.sub(r"[^A-Za-z0-9._-]", "_", r["system"])  # plug-in names carry ':'
        path = os.path.join(out, f"{name}__{system}__rate{r['request_rate']:.6g}.json")
        with open(path, "w") as f:
            json.dump(r, f, indent=1, sort_keys=True, allow_nan=False)
    with open(os.path.join(out, f"{name}__summary.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True, allow_nan=False)
    fit = env.cost_model.fit_error()
    header = (f"# Replay of `{name}` on {cfg.num_gpus} x {cfg.gpu}, {cfg.model}, SLO {cfg.slo}\n\n"
              f"Cost-model fit error (mean / max relative) per CP degree: "
              + ", ".join(f"C={c}: {m:.1%} / {x:.1%}" for c, (m, x) in fit.items()) + "\n\n")
    with open(os.path.join(out, f"{name}__summary.md"), "w") as f:
        f.write(header + report.markdown_table(results) + "\n")
    report.plot_vs_rate(results, os.path.join(out, f"{name}.png"),
                        f"{name}: {cfg.num_gpus} x {cfg.gpu}, {cfg.model}")


if __name__ == "__main__":
    app.run(main)
