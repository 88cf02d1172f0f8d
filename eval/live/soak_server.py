"""The server-side half of a soak run's accounting (`eval.live.soak`), and its abandoned requests.

- `metric_counts`: the request counters of `GET /metrics` (Prometheus text), each summed over
  its labels (`model_name`, `engine`, `finished_reason`, `reason`; `serving/prom.py`).
- `check_counts`: their change over the run against the client's ledger. Every request the
  server's API admitted is counted once, when it ends, in exactly one of
  `vertumnus:request_success_total` (completed, whether or not its client was still there),
  `..._aborted_total` (withdrawn before it started: its client disconnected),
  `..._rejected_total` (refused: 429, 503; also 413 and 408, which the soak does not provoke)
  or `..._failure_total` (a failed prefill, 500). So
  with no lost request, success + aborted + rejected + failure must grow by exactly answered +
  refused + abandoned, failure by 0, success by at least answered, aborted by at most
  abandoned, rejected by at least refused. A server that ran a request twice counts one too
  many; one that answered a request it never counted (or dropped one silently) one too few.
- `abandon`: sends a completion and closes its connection once the server is reading it. It
  sends `Expect: 100-continue`: uvicorn answers `100 Continue` when the app first reads the
  body, i.e. once `serving.http_gate.RequestGate` holds it (the body is already there), and from
  then on the request reaches the engine whatever the connection does. Without that wait a
  close could come before the gate read the body; the gate then drops the request uncounted
  (nothing to answer), and the server-side sum would no longer be exact.
- `pool_idle`: whether `GET /v1/workers` shows nothing queued, running or being re-carved (an
  abandoned request may still run unseen after the client stopped sending).
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse

from prometheus_client.parser import text_string_to_metric_families

from eval.live.soak_ledger import Outcome

# `metric_counts` keys -> the Prometheus samples summed into them (serving/prom.py)
COUNTERS = {"success": "vertumnus:request_success_total",
            "failure": "vertumnus:request_failure_total",
            "aborted": "vertumnus:request_aborted_total",
            "rejected": "vertumnus:request_rejected_total"}


def metric_counts(text: str) -> dict:
    """The request counters of a `GET /metrics` answer (Prometheus text format).

    Returns:
      `{"success", "failure", "aborted", "rejected"}` (requests, each summed over its labels)
      and `rejected_by_reason` ({reason: requests}).

    Raises:
      ValueError: the text does not parse, or a counter is missing.
    """
    out: dict = {"rejected_by_reason": {}}
    names = {v: k for k, v in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = names.get(sample.name)
            if key is None:
                continue
            out[key] = out.get(key, 0) + int(round(sample.value))
            if key == "rejected":
                reason, by = sample.labels.get("reason", ""), out["rejected_by_reason"]
                by[reason] = by.get(reason, 0) + int(round(sample.value))
    missing = [COUNTERS[k] for k in COUNTERS if k not in out]
    if missing:
        raise ValueError(f"GET /metrics lacks {', '.join(missing)}")
    return out


def check_counts(start: dict | None, end: dict | None, requests: dict) -> dict:
    """The server's request counters over the run (`metric_counts` at its start and end, None
    when unreadable) checked against the client's `Ledger.summary()` `requests`.

    Returns:
      `read` (both snapshots there), the deltas `success`, `failure`, `aborted`, `rejected`
      (requests), `rejected_by_reason`, `counted` (their sum), `expected` (answered + refused +
      abandoned), `abandoned_completed` (success - answered: abandoned requests that ran to
      completion unseen) and `problems` (empty: consistent). With lost requests `counted` may
      lie anywhere in `[expected, expected + lost]` (a lost request may or may not have reached
      the server); without, it must equal `expected`.
    """
    out: dict = {"read": start is not None and end is not None, "problems": []}
    if not out["read"]:
        out["problems"].append("GET /metrics could not be read at the "
                               + ("start" if start is None else "end"))
        return out
    d = {k: end[k] - start[k] for k in COUNTERS}
    answered, refused = requests["answered"], requests["refused"]
    abandoned, lost = requests.get("abandoned", 0), requests["lost"]
    expected = answered + refused + abandoned
    counted = sum(d.values())
    out.update(d, counted=counted, expected=expected,
               abandoned_completed=d["success"] - answered,
               rejected_by_reason={r: n - start["rejected_by_reason"].get(r, 0)
                                   for r, n in sorted(end["rejected_by_reason"].items())
                                   if n - start["rejected_by_reason"].get(r, 0)})
    p = out["problems"]
    if d["failure"]:
        p.append(f"{d['failure']} requests failed server-side (request_failure_total)")
    if d["success"] < answered:
        p.append(f"the server counted {d['success']} successes for {answered} answered "
                 "requests: it answered requests it did not count")
    if d["aborted"] > abandoned:
        p.append(f"the server withdrew {d['aborted']} requests (request_aborted_total) but "
                 f"only {abandoned} were abandoned")
    if d["rejected"] < refused:
        p.append(f"the server counted {d['rejected']} refusals (request_rejected_total) for "
                 f"{refused} refused requests")
    if counted > expected + lost:
        p.append(f"the server counted {counted} requests ended (success + aborted + rejected + "
                 f"failure) for {expected + lost} sent that reached it: a request ran twice")
    elif counted < expected:
        p.append(f"the server counted {counted} requests ended (success + aborted + rejected + "
                 f"failure) for {expected} answered, refused or abandoned: "
                 f"{expected - counted} never counted")
    return out


def pool_idle(state: dict | None) -> bool:
    """Whether `GET /v1/workers` (`state`; None: not read) shows no request queued or running
    on any worker and no split or merge in progress."""
    if state is None:
        return False
    return not state.get("reconfigurations_in_progress") and all(
        w.get("queued_requests") == 0 and not w.get("running") for w in state["workers"])


async def abandon(url: str, path: str, payload: dict, headers: dict, after_s: float,
                  timeout_s: float) -> Outcome:
    """POSTs `payload` (JSON) to `url` + `path` with `Expect: 100-continue` on a connection of
    its own, waits for the server's `100 Continue` (it is reading the body), waits `after_s`
    seconds more, and closes the connection (a reset), leaving the answer unread.

    Args:
      url: the server's base URL (http or https).
      path: e.g. "/v1/completions".
      payload: the JSON body.
      headers: more headers (e.g. `Authorization`, `X-Request-Id`).
      after_s: seconds from the `100 Continue` to the close.
      timeout_s: seconds the connection and the `100 Continue` may take.

    Returns:
      `Outcome("abandoned", 100, ...)`; or "lost" when no `100 Continue` came (a transport
      error, a timeout, or another answer first, e.g. a 401 before the body was read).
    """
    u = urllib.parse.urlsplit(url)
    body = json.dumps(payload).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {u.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Expect: 100-continue", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            u.hostname, u.port or (443 if u.scheme == "https" else 80),
            ssl=True if u.scheme == "https" else None), timeout_s)
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        parts = line.decode("latin-1").split()
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
        if status != 100:
            return Outcome("lost", status, f"no 100 Continue: {line[:80]!r}")
        await asyncio.sleep(after_s)
        return Outcome("abandoned", 100, "closed after 100 Continue")
    except (OSError, asyncio.TimeoutError, UnicodeError) as e:
        return Outcome("lost", None, f"{type(e).__name__}: {e}")
    finally:
        if writer is not None:
            writer.transport.abort()  # no FIN handshake: the server sees the connection lost
