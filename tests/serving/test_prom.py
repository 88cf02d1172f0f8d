"""`serving.prom.ServingMetrics` on its own: how each kind of ending is counted."""

from __future__ import annotations

import types

from prometheus_client.parser import text_string_to_metric_families

from serving.engine import Completion
from serving.policy.request import Request, RequestRecord
from serving.prom import ServingMetrics, build_1_2_5_buckets


def _metrics(model_name="m"):
    engine = types.SimpleNamespace(config=types.SimpleNamespace(max_model_len=100),
                                   scheduler=None)
    return ServingMetrics(engine, model_name=model_name)


def _samples(metrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def _record(**kw) -> Completion:
    request = Request("r", 10.0, 40, 1, (1, 2, 3), 16, None)
    return Completion(RequestRecord(request, **kw), None)


def test_each_ending_counted_once_under_its_reason():
    m = _metrics()
    m.observe(_record(worker_id=0, start_time=10.5, finish_time=11.0, first_token_time=11.25,
                      cached_len=16))
    m.observe(_record(finish_time=10.1, error="aborted: the client disconnected", aborted=True))
    m.observe(_record(finish_time=10.1, error="no worker can hold it"))  # worker_id None
    m.observe(_record(worker_id=1, start_time=10.0, finish_time=10.2, error="boom"))
    m.rejected.labels("overloaded").inc(3)  # as serving/api.py counts a refused batch
    s = _samples(m)
    me = (("engine", "0"), ("model_name", "m"))
    assert s[("vertumnus:request_success_total", (me[0], ("finished_reason", "length"),
                                                  me[1]))] == 1
    assert s[("vertumnus:e2e_request_latency_seconds_sum", me)] == 1.25
    assert s[("vertumnus:time_to_first_token_seconds_sum", me)] == 1.25
    assert s[("vertumnus:request_queue_time_seconds_sum", me)] == 0.5
    assert s[("vertumnus:request_prefill_time_seconds_sum", me)] == 0.5
    assert s[("vertumnus:prefix_cache_hits_total", me)] == 16
    assert s[("vertumnus:prompt_tokens_total", me)] == 40
    assert s[("vertumnus:request_aborted_total", (("model_name", "m"),
                                                  ("reason", "client_disconnected")))] == 1
    rejected = {dict(k[1])["reason"]: v for k, v in s.items()
                if k[0] == "vertumnus:request_rejected_total"}
    assert rejected == {"overloaded": 3, "shutting_down": 0, "no_worker_fits": 1,
                        "body_too_large": 0, "body_timeout": 0, "unauthorized": 0,
                        "forbidden": 0, "kv_hold_conflict": 0}
    assert s[("vertumnus:request_failure_total", (("model_name", "m"),))] == 1
    # the pool-wide gauges exist before the engine starts (vLLM dashboards find them)
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert s[(f"vertumnus:{g}", me)] == 0


def test_token_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
