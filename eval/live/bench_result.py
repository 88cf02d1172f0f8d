"""Per-request outputs and the result JSON of a load-generator run, as `vllm bench serve`.

`RequestOutput` is what the client keeps of one request (vLLM's `RequestFuncOutput`); times are
seconds on the client's clock. `vllm_metrics` turns a run's outputs into the keys that
`vllm/benchmarks/serve.py` writes with `--save-result --save-detailed`, computed the same way
(numpy; population standard deviation; linear-interpolation percentiles; statistics over
completed requests only):

- `duration` (s, first send to last answer), `completed`, `failed`;
- `total_input_tokens`, `total_output_tokens` (over completed requests), `request_throughput`
  (completed / duration, req/s), `output_throughput` and `total_token_throughput` (tok/s);
- per request, in send order: `input_lens` (prompt tokens sent), `output_lens` (tokens
  generated; 0 for a failed request), `ttfts` (s, send to the first token), `itls` (s, a list
  per request: the gaps between token-carrying chunks), `latencies` (s, send to the last token),
  `start_times` (s after the run's start), `generated_texts`, `errors` ("" when it succeeded);
- for each metric `m` of `PERCENTILE_METRICS` asked for (`ttft`, `tpot`, `itl`, `e2el`):
  `mean_{m}_ms`, `median_{m}_ms`, `std_{m}_ms` and `p{P}_{m}_ms` for each percentile `P`, in
  milliseconds; None over an empty set (vLLM writes 0 there).

The run's own keys (`date`, `backend`, `model_id`, ...) are added by `eval.live.loadgen`;
`result_filename` names the file and `write_new` writes it without ever replacing another.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Sequence

import numpy as np

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class RequestOutput:
    """One request as the client saw it (seconds; vLLM's `RequestFuncOutput`).

    Attributes:
      prompt_len: prompt tokens sent.
      start_time: when it was sent, seconds after the run's start.
      success: True when a first token came back.
      ttft: send to first token (s); 0 on failure.
      latency: send to the last token (s); 0 on failure.
      itl: gaps between consecutive token-carrying chunks (s).
      generated_text: the text of the tokens received.
      output_tokens: tokens generated (the server's `usage.completion_tokens` when it reports
        it, else the token-carrying chunks counted).
      cached_tokens: `usage.prompt_tokens_details.cached_tokens` when reported, else None.
      error: why it failed ("" when it succeeded).
    """

    prompt_len: int
    start_time: float = 0.0
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    generated_text: str = ""
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str = ""


def parse_percentiles(text: str) -> list[float]:
    """`"90,99"` -> `[90.0, 99.0]`.

    Raises:
      ValueError: naming `--metric_percentiles`, when an entry is not a number in (0, 100] or
        the list is empty.
    """
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"--metric_percentiles must be a comma-separated list of numbers in "
                         f"(0, 100], got {text!r}")
    return values


def parse_metrics(text: str) -> list[str]:
    """`"ttft,itl"` -> `["ttft", "itl"]`.

    Raises:
      ValueError: naming `--percentile_metrics` and the allowed names, on an unknown name or
        an empty list.
    """
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or any(m not in PERCENTILE_METRICS for m in names):
        raise ValueError(f"--percentile_metrics must be a comma-separated subset of "
                         f"{','.join(PERCENTILE_METRICS)}, got {text!r}")
    return names


def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean / median / std / pP of `values` (seconds) in milliseconds; None when empty."""
    a = np.asarray(values, dtype=np.float64)
    out = {f"{k}_{name}_ms": (float(f(a)) * 1e3 if a.size else None)
           for k, f in (("mean", np.mean), ("median", np.median), ("std", np.std))}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(a, p)) * 1e3 if a.size else None
    return out


def vllm_metrics(outputs: Sequence[RequestOutput], duration: float,
                 percentiles: Sequence[float] = (90, 99),
                 metrics: Sequence[str] = PERCENTILE_METRICS) -> dict:
    """The `vllm bench serve` keys of one run (module doc).

    Args:
      outputs: one per request sent, in send order.
      duration: seconds from the first send to the last answer (> 0 for throughputs).
      percentiles: the `pP` keys to write, each in (0, 100].
      metrics: which of `PERCENTILE_METRICS` get statistics.

    Returns:
      A JSON-ready dict (throughputs None when `duration` is 0).
    """
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(output_lens)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    out = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "input_lens": [o.prompt_len for o in outputs], "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [list(o.itl) for o in outputs],
        "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    values = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    for m in metrics:
        out.update(_stats(m, values[m], percentiles))
    return out


def result_filename(backend: str, model_id: str, workload: str, now: float | None = None) -> str:
    """`<backend>-<model>-<workload>-<YYYYmmdd-HHMMSS>.json` (local time `now`, default the
    current time; the model's last path part, as vLLM names it, with characters other than
    letters, digits, `.`, `_` and `-` made `_`)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    parts = [re.sub(r"[^A-Za-z0-9._-]", "_", s) or "_"
             for s in (backend, model_id.rstrip("/").split("/")[-1], workload)]
    return "-".join([*parts, stamp]) + ".json"


def write_new(path: str, result: dict, unique: bool = True) -> str:
    """Writes `result` as JSON to `path`, never replacing a file: if `path` exists, with
    `unique` the first free `<stem>-1.json`, `<stem>-2.json`, ... is written instead.

    Returns:
      The path written.

    Raises:
      FileExistsError: `path` exists and `unique` is False.
      ValueError: `result` holds a NaN or an infinity (not JSON).
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    stem, ext = os.path.splitext(path)
    candidates = (path if k == 0 else f"{stem}-{k}{ext}" for k in range(10**6 if unique else 1))
    text = json.dumps(result, indent=1, sort_keys=True, allow_nan=False)
    for candidate in candidates:
        try:
            with open(candidate, "x") as f:
                f.write(text)
            return candidate
        except FileExistsError:
            if not unique:
                raise
    raise FileExistsError(f"no free file name next to {path}")  # pragma: no cover
