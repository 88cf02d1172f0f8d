"""What the paper's comparison runs: its setups, baselines, load factors and workloads.

Shared by `eval.paper` (the comparison) and `eval.robustness` (the same comparison on parts of
the workloads), so both sweep the same cells.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable

from eval.traces.loaders import load_trace
from eval.traces.sessions import load_sessions
from eval.traces.workloads import tool_agent_workload

# The public traces: $VERTUMNUS_TRACES_DIR, else ../shared/traces beside the repository.
DEFAULT_TRACES_DIR = os.environ.get("VERTUMNUS_TRACES_DIR") or str(
    pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "traces")
BASELINES_24 = ("homogeneous-cp2", "homogeneous-cp4", "static-threshold", "vllm-tp4",
                "sglang-cp4", "dynamo-cp4", "mooncake-cp4")
BASELINES_48 = ("homogeneous-cp4", "homogeneous-cp8", "static-threshold", "sglang-cp4",
                "dynamo-cp4", "mooncake-cp4")
SETUPS = (("qwen3-30b-a3b", (2, 4), BASELINES_24), ("qwen3-32b", (4, 8), BASELINES_48))
LOADS = {"production": (0.6, 0.9, 1.1, 1.3), "leval": (0.6, 0.9, 1.2, 1.5),
         "leval-csv": (1.0, 2.0, 3.0, 4.0),
         "toolagent": (1.0, 1.5, 2.0, 2.5), "code": (0.6, 0.9, 1.2, 1.5),
         "agents": (0.1, 0.2, 0.3, 0.4),
         # `eval.robustness`' synthetic stand-ins: as the code trace; with one cached system
         # prompt (93 % of a prompt) the best baseline saturates between 6 and 8 (measured)
         "synthetic": (0.6, 0.9, 1.2, 1.5), "synthetic-prefix": (2.0, 4.0, 6.0, 8.0)}
AGENT_WINDOW_S = 3600.0  # agent sessions start during the first hour (eval.replay's default)
QUICK_REQUESTS, QUICK_AGENT_WINDOW_S = 1500, 600.0  # --quick: shorter traces and windows
OURS = ("vertumnus", "vertumnus-paper", "vertumnus-paper+replay", "vertumnus-nocache",
        "vertumnus-fetch", "vertumnus-fcfs")
# Built-in variants of ours that `eval.paper` does not run (never a cell's best baseline when
# named in `--systems` of another run).
OTHER_OURS = ("vertumnus-static", "vertumnus-gated-sjf")


def best_baseline(results: Iterable[dict], ours: dict | None = None
                  ) -> tuple[dict | None, dict | None]:
    """The best baseline of one cell (one workload, setup and load), like for like, and the
    fastest baseline when it is another one.

    Args:
      results: the cell's results (`eval.experiment.run_sweep`'s dicts: `system`,
        `mean_ttft_ms`, `failed`); those of systems in `OURS` or `OTHER_OURS` and those
        without a mean TTFT (every request failed) are skipped.
      ours: the result the baselines are held against (`vertumnus`'s), or None.

    Returns:
      `(best, faster)`: `best` the baseline of least mean TTFT among those that failed no more
      requests than `ours` (all of them without `ours`; where every baseline failed more, those
      that failed fewest); `faster` the baseline of least mean TTFT of all when its mean is
      below `best`'s (it failed more requests than `ours`), else None; `(None, None)` without
      a baseline. A missing or None `failed` counts as 0. Where `ours` failed more than `best`,
      its own mean is the one over fewer requests: the callers show both counts.

    A failed request has no TTFT, so a mean over fewer requests, the refused ones left out
    (prompts longer than a pool's workers hold: the longest and slowest), is not one over the
    same workload: `homogeneous-cp4` on H100 with Qwen3-32B refuses the
    Mooncake conversation's prompts of 98K tokens and more (46 of 6,015 in its first half),
    which `vertumnus` serves on CP-8 workers (eval/RESULTS.md, "Another GPU").
    """
    ours_names = OURS + OTHER_OURS
    timed = [r for r in results if r["system"] not in ours_names and r["mean_ttft_ms"]]
    if not timed:
        return None, None
    cap = (ours.get("failed") or 0) if ours is not None else None
    fair = [r for r in timed if cap is None or (r.get("failed") or 0) <= cap]
    if not fair:  # every baseline refused more: the ones that refused fewest
        least = min(r.get("failed") or 0 for r in timed)
        fair = [r for r in timed if (r.get("failed") or 0) == least]
    best = min(fair, key=lambda r: r["mean_ttft_ms"])
    fastest = min(timed, key=lambda r: r["mean_ttft_ms"])
    return best, (fastest if fastest["mean_ttft_ms"] < best["mean_ttft_ms"] else None)


# The public trace files of the comparison's workloads, under the traces folder (its README).
TRACE_FILES = {"production": "mooncake/conversation_trace.jsonl",
               "leval": "mooncake/synthetic_trace.jsonl",
               "leval-csv": "leval/leval_requests_llama3tok.csv",
               "code": "azure2023/AzureLLMInferenceTrace_code.csv",
               "agents": "agent_sessions"}


def shared_workloads(traces_dir: str | pathlib.Path, quick: bool = False) -> dict:
    """The six workloads of the comparison, by name (`LOADS`' keys), from the public traces.

    Args:
      traces_dir: the folder of the public traces (`../shared/traces`: its README).
      quick: the first `QUICK_REQUESTS` requests of each trace, a 600 s Tool-Agent run.

    Returns:
      name -> requests (`SessionWorkload` for "agents", replayed closed-loop).

    Raises:
      OSError, ValueError: a trace is missing or malformed (`eval.traces.loaders`).
    """
    d = pathlib.Path(traces_dir)
    out = {name: load_trace(d / TRACE_FILES[name]).requests
           for name in ("production", "leval")}
    out["leval-csv"] = load_trace(d / TRACE_FILES["leval-csv"], rate=1.0,
                                  seed=0).requests  # (rescaled per load)
    out["toolagent"] = tool_agent_workload(duration_s=600.0 if quick else 3600.0, seed=0)
    out["code"] = load_trace(d / TRACE_FILES["code"]).requests
    if quick:
        out = {k: v[:QUICK_REQUESTS] for k, v in out.items()}
    out["agents"] = load_sessions(d / TRACE_FILES["agents"])  # (--quick: a shorter window)
    return out
