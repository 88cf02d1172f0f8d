"""Serving metrics of a replay: TTFT statistics, SLO attainment, goodput, prefix hits, GPU time.

Key names follow `vllm bench serve`'s result JSON (`completed`, `mean_ttft_ms`, `p90_ttft_ms`,
`request_goodput`, ...) plus this project's own (`slo_attainment`,
`token_weighted_slo_attainment`, `prefix_hit_rate`, `gpu_seconds`, ...).

Definitions (L_i input tokens, S_i TTFT SLO, T_i TTFT of request i; failed requests miss):
- percentiles: `numpy.percentile`, linear interpolation, over completed requests;
- `slo_attainment = #{i: T_i <= S_i} / #{i}` over requests that have an SLO;
- `token_weighted_slo_attainment = sum_i L_i [T_i <= S_i] / sum_i L_i` (the paper's objective);
- `request_goodput = #{i: T_i <= S_i} / duration`, duration from the first arrival to the last
  first token (seconds), as vLLM's goodput (req/s);
- `prefix_hit_rate = sum cached_len / sum input_len` over completed requests (token level);
- `gpu_seconds = sum_i C_i * (finish_i - start_i)`: device-seconds spent in prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serving.policy.request import RequestRecord

PERCENTILES = (90, 99)  # the median is `median_ttft_ms`


def summarize(records: Sequence[RequestRecord]) -> dict:
    """Computes the metrics above for one run.

    Args:
      records: one per request (completed or failed), any order.

    Returns:
      A flat dict of floats and ints (JSON-ready). TTFT keys are in milliseconds, `*_s` keys in
      seconds. Statistics over an empty set are `None`.
    """
    ok = [r for r in records if r.ok]
    ttft = np.array([r.ttft for r in ok], dtype=np.float64)
    queue = np.array([r.start_time - r.request.arrival_time for r in ok], dtype=np.float64)
    prefill = np.array([r.finish_time - r.start_time for r in ok], dtype=np.float64)
    reasons: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error if len(r.error) <= 120 else r.error[:117] + "..."
            reasons[key] = reasons.get(key, 0) + 1
    out: dict = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5]),
    }
    if len(records):
        first_arrival = min(r.request.arrival_time for r in records)
        last_end = max((r.first_token_time if r.ok else r.finish_time) or first_arrival
                       for r in records)
        duration = max(last_end - first_arrival, 0.0)
    else:
        duration = 0.0
    out["duration_s"] = duration
    out["request_throughput"] = len(ok) / duration if duration > 0 else None
    out["mean_ttft_ms"] = _ms(ttft.mean()) if len(ttft) else None
    out["median_ttft_ms"] = _ms(np.percentile(ttft, 50)) if len(ttft) else None
    out["std_ttft_ms"] = _ms(ttft.std()) if len(ttft) else None
    for p in PERCENTILES:
        out[f"p{p}_ttft_ms"] = _ms(np.percentile(ttft, p)) if len(ttft) else None
    out["mean_queue_ms"] = _ms(queue.mean()) if len(queue) else None
    out["mean_prefill_ms"] = _ms(prefill.mean()) if len(prefill) else None

    with_slo = [r for r in records if r.request.ttft_slo is not None]
    met = [r for r in with_slo if r.ok and r.ttft <= r.request.ttft_slo]
    tokens_all = sum(r.request.input_len for r in with_slo)
    tokens_met = sum(r.request.input_len for r in met)
    out["requests_with_slo"] = len(with_slo)
    out["mean_ttft_slo_ms"] = (_ms(np.mean([r.request.ttft_slo for r in with_slo]))
                               if with_slo else None)
    out["slo_attainment"] = len(met) / len(with_slo) if with_slo else None
    out["token_weighted_slo_attainment"] = tokens_met / tokens_all if tokens_all else None
    out["request_goodput"] = len(met) / duration if with_slo and duration > 0 else None

    input_tokens = sum(r.request.input_len for r in ok)
    cached = sum(r.cached_len for r in ok)
    out["total_input_tokens"] = input_tokens
    out["total_cached_tokens"] = cached
    out["prefix_hit_rate"] = cached / input_tokens if input_tokens else None
    out["gpu_seconds"] = float(sum(r.cp_degree * (r.finish_time - r.start_time) for r in ok))
    return out


def _ms(seconds: float) -> float:
    return float(seconds) * 1e3
