"""The result of a soak run (`eval.live.soak`): assembled as a JSON-able dict, judged, printed.

`assemble` gathers what the run's coroutines counted; `failures` names what makes the run fail
(a lost, duplicated or inconsistent answer, too many refusals or no answer at all, server-side
counters that disagree with the client, a stuck or failed reconfiguration, operations that
stopped early, error lines in the server's log, an unclean server exit); `verdict` turns that
and the stop reason into the exit status; `table` is the markdown table `python -m eval.soak`
prints; `server_log_errors` counts the error lines of the launched server's log.

What no check covers: the first token of a unique prompt (there is no reference for it); an
answer swapped between two requests of the same prompt length (`usage.prompt_tokens` is the
only echo of the prompt; lengths are drawn from `prompt_lengths`, so this goes unseen with
probability 1 / (max - min + 1) per swap, unless a repeated prompt's first token differs); the
`kv_transfer_params` of an answer (no decode side reads them); refusals of abandoned requests
(counted server-side only, in `server_counts.rejected`).
"""

from __future__ import annotations

import dataclasses
import re

from eval.live.soak_ledger import distribution

_ERROR_LINE = re.compile(r"^(E\d{4} |F\d{4} |ERROR|CRITICAL|Traceback)")
# `verdict`'s exit statuses of `python -m eval.soak`
EXIT_STATUS = {"passed": 0, "failed": 1, "incomplete": 2, "interrupted": 130}
_ENDED = ("done", "deadline", "interrupted")  # stop reasons that are not failures themselves


def assemble(run, reason: str, start_state: dict | None, end_state: dict | None,
             drain_s: float, server_counts: dict | None = None) -> dict:
    """The result of a finished run.

    Args:
      run: the run's shared state (`eval.live.soak_run.SoakRun`).
      reason: why the operations stopped ("done", "deadline", "stuck", ...).
      start_state, end_state: `GET /v1/workers` before the stream and after it (None when the
        server did not answer).
      drain_s: seconds the requests in flight at the stop took to finish.
      server_counts: `eval.live.soak_server.check_counts` (None: not checked, a failure).

    Returns:
      A JSON-able dict: `config` (keys left out), `stop_reason`, `wall_s`, `final_drain_s`,
      `requests` (`Ledger.summary`), `latency_ms` (client-side, answered requests),
      `first_token` (`FirstTokens.summary`), `reconfigurations` (counts, refusals, errors,
      and `time_s`: server-side total / drain / re-carve and client-observed distributions,
      seconds), `rss_mib` (start, after the first tenth of the operations, end, max,
      samples as [seconds, MiB]), compositions, `poll_errors`, and `operations` (one record
      per finished split or merge, the server's log entry plus `client_s` and `at_s`),
      `server_counts`.
    """
    cfg, ops = run.cfg, run.ops
    done = [o for o in ops if o.get("drained") is not None]
    rss = [m for _, m in run.rss]
    return {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if "key" not in k},
        "stop_reason": reason, "wall_s": round(run.elapsed(), 3),
        "final_drain_s": round(drain_s, 3),
        "requests": run.ledger.summary(),
        "latency_ms": distribution(run.latencies_ms),
        "first_token": run.tokens.summary(),
        "reconfigurations": {
            "target": cfg.operations, "done": len(ops),
            "splits": sum(o["kind"] == "split" for o in ops),
            "merges": sum(o["kind"] == "merge" for o in ops),
            "refused": sum(run.op_refused.values()),
            "refused_by_code": {str(k): v for k, v in sorted(run.op_refused.items())},
            "refusal_examples": run.op_refusal_examples,
            "errors": run.op_errors, "stuck": run.stuck,
            "compositions_seen": len({tuple(o["composition"]) for o in ops}),
            "time_s": {
                "server_total": distribution([o["finished"] - o["started"] for o in ops]),
                "server_drain": distribution([o["drained"] - o["started"] for o in done]),
                "server_recarve": distribution([o["finished"] - o["drained"] for o in done]),
                "client": distribution([o["client_s"] for o in ops])}},
        "rss_mib": {"start": rss[0] if rss else None, "after_10pct_operations": run.rss_warm,
                    "end": rss[-1] if rss else None, "max": max(rss, default=None),
                    "samples": run.rss},
        "composition_start": (start_state or {}).get("composition"),
        "composition_end": (end_state or {}).get("composition"),
        "epoch_end": (end_state or {}).get("epoch"),
        "poll_errors": dict(run.poll_errors),
        "server_counts": server_counts or {"read": False, "problems": ["not checked"]},
        "operations": ops,
    }


def server_log_errors(path: str, examples: int = 10) -> dict:
    """`{"lines": n, "examples": [...]}`: the error lines of a server log (absl `E`/`F` lines,
    `ERROR`, `CRITICAL`, tracebacks); `lines` is None when the log cannot be read."""
    try:
        with open(path, errors="replace") as f:
            hits = [line.rstrip() for line in f if _ERROR_LINE.match(line)]
    except OSError:
        return {"lines": None, "examples": []}
    return {"lines": len(hits), "examples": hits[:examples]}


def failures(result: dict) -> list[str]:
    """Why the run failed (empty: it passed, or stopped early without a failure): lost,
    duplicated or first-token-inconsistent answers; refusals (429, 503) above
    `max_refused_fraction` of the requests sent, or no answer at all; server-side counters that
    disagree with the client (`server_counts.problems`); a stuck or failed reconfiguration (any
    answer but 200 and 409); operations that stopped early for any reason but "done",
    "deadline" and "interrupted"; error lines in the launched server's log (or a log that
    cannot be read); a launched server that did not exit 0."""
    req, ops, cfg = result["requests"], result["reconfigurations"], result["config"]
    out = []
    if req["lost"]:
        out.append(f"{req['lost']} requests lost ({req['lost_reasons']})")
    if req["duplicated"]:
        out.append(f"{req['duplicated']} requests duplicated")
    if req["refused"] > cfg["max_refused_fraction"] * req["sent"]:
        out.append(f"{req['refused']} of {req['sent']} requests refused "
                   f"({req.get('refused_reasons', req['refused_by_code'])}), more than "
                   f"--max_refused_fraction={cfg['max_refused_fraction']:g}")
    if not req["answered"]:
        out.append(f"no request was answered ({req['sent']} sent)")
    out += [f"server counters: {p}" for p in result["server_counts"]["problems"]]
    bad = result["first_token"]["mismatched_prompts"]
    if bad:
        out.append(f"{bad} repeated prompts got different first tokens")
    if ops["stuck"]:
        out.append(f"a {ops['stuck']['kind']} (epoch {ops['stuck']['epoch']}) did not finish "
                   f"within {cfg['reconfig_timeout_s']} s")
    if ops["errors"]:
        out.append(f"{len(ops['errors'])} split/merge requests failed with an answer other "
                   f"than 200 or 409 (first: {ops['errors'][0]})")
    if result["stop_reason"] not in _ENDED and result["stop_reason"] != "stuck":
        out.append(f"the operations stopped early: {result['stop_reason']}")
    log = result.get("server_log_errors")
    if log is not None and log.get("lines") != 0:
        out.append(f"server log {result.get('server_log')}: " + (
            "cannot be read" if log.get("lines") is None else
            f"{log['lines']} error lines (first: {log['examples'][:3]})"))
    if result.get("server_exit_status") not in (None, 0):
        out.append(f"the server exited with status {result['server_exit_status']}")
    return out


def verdict(result: dict) -> str:
    """"failed" (`result["failures"]`, else `failures(result)`, not empty), "interrupted"
    (a Ctrl-C), "incomplete" (`max_duration_s` passed before `operations` finished) or
    "passed"; `EXIT_STATUS` maps it to the exit status."""
    bad = result["failures"] if "failures" in result else failures(result)
    if bad:
        return "failed"
    return {"interrupted": "interrupted", "deadline": "incomplete"}.get(
        result["stop_reason"], "passed" if result["stop_reason"] == "done" else "failed")


def _dist(d: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if not d["n"]:
        return "-"
    return " / ".join(fmt.format(d[k] * scale) for k in ("mean", "p50", "p90", "max"))


def _counts(c: dict) -> str:
    if not c.get("read"):
        return "not read (a failure)"
    ok = "" if c["problems"] else ", consistent"
    return (f"{c['success']} / {c['aborted']} / {c['rejected']} / {c['failure']} (sum "
            f"{c['counted']}, expected {c['expected']}{ok}; abandoned: "
            f"{c['abandoned_completed']} completed unseen, {c['aborted']} withdrawn)")


def _mib(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(result: dict) -> str:
    """The markdown table of a result: requests, answers, consistency, reconfigurations and
    their times, server RSS, wall time."""
    req, ops, ft = result["requests"], result["reconfigurations"], result["first_token"]
    codes = ", ".join(f"{c}: {n}" for c, n in req["refused_reasons"].items())
    op_codes = ", ".join(f"{c}: {n}" for c, n in ops["refused_by_code"].items())
    t, rss = ops["time_s"], result["rss_mib"]
    log = result.get("server_log_errors") or {}
    rows = [
        ("requests sent", f"{req['sent']}"),
        ("answered (200)", f"{req['answered']}"),
        ("refused (429, 503; <= max_refused_fraction)",
         f"{req['refused']}" + (f" ({codes})" if codes else "")),
        ("lost (must be 0)", f"{req['lost']}" + (f" {req['lost_reasons']}" if req["lost"]
                                                 else "")),
        ("abandoned (closed on purpose)", f"{req['abandoned']}"),
        ("duplicated (must be 0)", f"{req['duplicated']}"),
        ("server counters: success / aborted / rejected / failure",
         _counts(result["server_counts"])),
        ("first-token mismatches (must be 0)",
         f"{ft['mismatched_prompts']} of {ft['prompts']} repeated prompts ({ft['observations']} "
         f"answers; {ft['multi_degree_prompts']} prompts served at >= 2 CP degrees, degrees "
         f"{ft['degrees_seen']})"),
        ("latency mean / P50 / P90 / max (ms)", _dist(result["latency_ms"], fmt="{:.0f}")),
        ("reconfigurations done", f"{ops['done']} of {ops['target']} ({ops['splits']} splits, "
                                  f"{ops['merges']} merges, {ops['compositions_seen']} "
                                  "compositions)"),
        ("reconfigurations refused", f"{ops['refused']}" + (f" ({op_codes})" if op_codes
                                                            else "")),
        ("reconfiguration failures (must be 0)",
         f"{len(ops['errors']) + bool(ops['stuck'])}"),
        ("reconfig. time, server, mean / P50 / P90 / max (s)", _dist(t["server_total"])),
        ("  of which draining (s)", _dist(t["server_drain"])),
        ("  of which re-carving (s)", _dist(t["server_recarve"])),
        ("reconfig. time, client-observed (s)", _dist(t["client"])),
        ("server RSS start / after 10 % / end / max (MiB)",
         " / ".join(_mib(rss[k]) for k in ("start", "after_10pct_operations", "end", "max"))),
        ("composition start -> end", f"{result['composition_start']} -> "
                                     f"{result['composition_end']}"),
        ("wall (s)", f"{result['wall_s']:.0f} (stopped: {result['stop_reason']})"),
    ]
    if "server_exit_status" in result:
        rows.append(("server exit status / error lines in its log",
                     f"{result['server_exit_status']} / {log.get('lines')}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'quantity'.ljust(width)} | value |", f"|{'-' * (width + 2)}|---|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)
