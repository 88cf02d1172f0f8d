"""`GET /metrics` against vLLM v1's names, labels and buckets, and the Grafana dashboard
(`serving/grafana/vertumnus-dashboard.json`) against what the real app exports."""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serving.api import create_app
from serving.prom import DASHBOARD
from serving.tokenizer import ByteTokenizer
from tests.serving.api_fixtures import make_app, make_client, wait_until

# vLLM v1 (`vllm/v1/metrics/loggers.py`), copied here so the test does not read our constants.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# vLLM's series whose concept the pool has: family name -> type.
VLLM_SERIES = {
    "time_to_first_token_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge"}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}


def promql_metrics(expr: str) -> set[str]:
    """The metric (sample) names a PromQL expression selects: identifiers that are not
    functions, keywords, label names or matchers, grouping labels, durations or variables."""
    e = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    out = set()
    for m in re.finditer(r"(?<![\w.$:])[A-Za-z_:][\w:]*", e):
        if m.group().lower() in _KEYWORDS or re.match(r"\s*\(", e[m.end():]):
            continue  # a keyword, or a function call
        out.add(m.group())
    return out


def template_metrics(query: str) -> set[str]:
    """The metrics of a Grafana query variable: `label_values(<selector>, <label>)` (the label
    is not a metric; `label_values(<label>)` selects none), else a PromQL query."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query, re.S)
    if m:
        return promql_metrics(m.group(1))
    return set() if query.strip().startswith("label_values(") else promql_metrics(query)


def family_of(sample: str, families: dict) -> str | None:
    """The exported family `sample` belongs to, with a suffix its type allows; None if none."""
    for suffix, kinds in (("_bucket", ("histogram",)), ("_sum", ("histogram", "summary")),
                          ("_count", ("histogram", "summary")), ("_total", ("counter",))):
        base = sample[:-len(suffix)]
        if sample.endswith(suffix) and families.get(base) in kinds:
            return base
    return sample if families.get(sample) in ("gauge", "unknown", "info") else None


def test_promql_metrics_extractor():
    expr = ('histogram_quantile(0.99, sum by(le) (rate(vertumnus:ttft_bucket{model_name='
            '"$model_name", le!="a{b}"}[$__rate_interval] offset 5m)))\n/ on(job) group_left '
            'sum without (engine) (up) > bool 1e3 and process_cpu_seconds_total')
    assert promql_metrics(expr) == {"vertumnus:ttft_bucket", "up", "process_cpu_seconds_total"}
    assert template_metrics("label_values(vertumnus:epoch{a=\"b\"}, model_name)") == {
        "vertumnus:epoch"}
    assert template_metrics("label_values(model_name)") == set()
    fams = {"a": "histogram", "b": "counter", "c": "gauge"}
    assert [family_of(s, fams) for s in ("a_bucket", "a_sum", "b_total", "c", "b", "c_total",
                                         "a")] == ["a", "a", "b", "c", None, None, None]


def _scrape(client) -> tuple[dict, list]:
    fams = list(text_string_to_metric_families(client.get("/metrics").text))
    return {f.name: f.type for f in fams}, [s for f in fams for s in f.samples]


def _value(samples, name: str, **labels) -> float:
    found = [s.value for s in samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{len(found)} samples {name} {labels}"
    return found[0]


def test_every_series_the_dashboard_queries_is_exported():
    board = json.loads(DASHBOARD.read_text())
    assert {"name": "DS_PROMETHEUS", "type": "datasource"}.items() <= \
        board["__inputs"][0].items()
    exprs, panels = [], [p for p in board["panels"] if p["type"] != "row"]
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            exprs.append(t["expr"])
    used = set().union(*map(promql_metrics, exprs), *(
        template_metrics(v["query"]["query"]) for v in board["templating"]["list"]
        if v["type"] == "query"))
    c, _ = make_client(seconds=0.01)
    with c:
        assert c.post("/v1/completions", json={"prompt": [5] * 20}).status_code == 200
        families, samples = _scrape(c)
    names = {s.name for s in samples}
    missing = sorted(u for u in used if u not in names or family_of(u, families) is None)
    assert not missing, f"the dashboard queries series /metrics does not export: {missing}"
    queried = {family_of(u, families) for u in used}
    assert {f"vertumnus:{n}" for n in VLLM_SERIES} - {"vertumnus:request_generation_tokens"} \
        <= queried
    assert {"vertumnus:request_rejected", "vertumnus:request_aborted", "vertumnus:workers",
            "vertumnus:reconfigurations"} <= queried
    titles = " ".join(p["title"] for p in panels).lower()
    for word in ("first token", "e2e", "queue", "prefill", "throughput", "kv cache",
                 "hit rate", "rejected", "aborted", "workers", "reconfigurations"):
        assert word in titles


def test_vllm_names_labels_and_buckets():
    app, _ = make_app(seconds=0.01)
    c = TestClient(app)
    with c:
        assert c.post("/v1/completions", json={"prompt": [5] * 20}).status_code == 200
        families, samples = _scrape(c)
    for name, kind in VLLM_SERIES.items():
        assert families.get(f"vertumnus:{name}") == kind, name
        rows = [s for s in samples if s.name.startswith(f"vertumnus:{name}")
                and not s.name.endswith("_created")]
        assert rows and all(s.labels["model_name"] == "tiny" and s.labels["engine"] == "0"
                            for s in rows), name
    for name, buckets in (("time_to_first_token_seconds", VLLM_TTFT),
                          ("e2e_request_latency_seconds", VLLM_LATENCY),
                          ("request_queue_time_seconds", VLLM_LATENCY),
                          ("request_prefill_time_seconds", VLLM_LATENCY)):
        les = [float(s.labels["le"]) for s in samples if s.name == f"vertumnus:{name}_bucket"]
        assert les == buckets + [float("inf")], name
    les = [s.labels["le"] for s in samples if s.name == "vertumnus:request_prompt_tokens_bucket"]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0",
                   "1000.0", "+Inf"]  # 1-2-5 up to max_model_len=1024
    vertumnus = [s for s in samples if s.name.startswith("vertumnus:")]
    assert vertumnus and all(s.labels.get("model_name") == "tiny" for s in vertumnus)
    assert "queue_time_seconds" not in families and "vertumnus:prefill_time_seconds" not in families
    assert "python_info" in families and "process_cpu_seconds" in families


def test_model_name_is_the_first_served_name():
    _, engine = make_app()
    app = create_app(engine, tokenizer=ByteTokenizer(256), model_name="tiny", vocab_size=256,
                     served_model_names=["org/served", "alias"])
    with TestClient(app) as c:
        assert c.post("/v1/completions", json={"prompt": [1, 2], "model": "alias"}
                      ).status_code == 200
        _, samples = _scrape(c)
    labels = {s.labels.get("model_name") for s in samples if s.name.startswith("vertumnus:")}
    assert labels == {"org/served"}
    assert _value(samples, "vertumnus:request_success_total", model_name="org/served") == 1


def test_counts_after_n_completions_match_the_answers():
    c, _ = make_client(seconds=0.01)
    prompts = [[3] * 40, [3] * 40 + [4] * 9, [9] * 17, "hello world", [3] * 40]
    with c:
        answers = [c.post("/v1/completions", json={"prompt": p}).json() for p in prompts]
        _, s = _scrape(c)
    n = len(prompts)
    tokens = sum(len(p) for p in prompts)  # byte-level tokenizer: one token per character
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert _value(s, "vertumnus:request_success_total", model_name="tiny",
                  finished_reason="length") == n
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_prompt_tokens", "request_generation_tokens"):
        assert _value(s, f"vertumnus:{h}_count") == n
    assert _value(s, "vertumnus:prompt_tokens_total") == tokens
    assert _value(s, "vertumnus:request_prompt_tokens_sum") == tokens
    assert _value(s, "vertumnus:generation_tokens_total") == n
    assert _value(s, "vertumnus:prefix_cache_queries_total") == tokens
    assert _value(s, "vertumnus:prefix_cache_hits_total") == cached >= 32
    ttft = sum(a["timings"]["ttft_seconds"] for a in answers)
    queue = sum(a["timings"]["queue_seconds"] for a in answers)
    prefill = sum(a["timings"]["prefill_seconds"] for a in answers)
    assert _value(s, "vertumnus:time_to_first_token_seconds_sum") == pytest.approx(ttft)
    assert _value(s, "vertumnus:request_queue_time_seconds_sum") == pytest.approx(queue)
    assert _value(s, "vertumnus:request_prefill_time_seconds_sum") == pytest.approx(prefill)
    e2e = _value(s, "vertumnus:e2e_request_latency_seconds_sum")
    assert e2e >= max(ttft, queue + prefill) - 1e-9 and e2e >= 5 * 0.01
    assert _value(s, "vertumnus:request_rejected_total", reason="overloaded") == 0


def test_pool_gauges_are_the_sum_of_the_workers():
    c, _ = make_client(seconds=1.0, composition=(8,))
    with c, concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(c.post, "/v1/completions", json={"prompt": [i + 1] * 33})
                   for i in range(3)]
        wait_until(lambda: c.get("/v1/workers").json()["workers"][0]["queued_requests"] == 2)
        _, s = _scrape(c)
        assert [f.result().status_code for f in futures] == [200] * 3
        workers = c.get("/v1/workers").json()["workers"]
        _, after = _scrape(c)
    assert _value(s, "vertumnus:num_requests_running", engine="0") == 1
    assert _value(s, "vertumnus:num_requests_waiting", engine="0") == 2
    assert _value(s, "vertumnus:worker_num_requests_waiting", worker_id="0", cp_degree="8") == 2
    assert _value(after, "vertumnus:num_requests_running") == 0
    assert _value(after, "vertumnus:num_requests_waiting") == 0
    cached, total = workers[0]["kv_blocks_cached"], workers[0]["kv_blocks_total"]
    assert cached == 6  # 3 prompts of 2 full blocks each
    assert _value(after, "vertumnus:kv_cache_usage_perc") == cached / total
    assert _value(after, "vertumnus:worker_kv_cache_usage_blocks", worker_id="0") == cached
    assert _value(after, "vertumnus:workers", cp_degree="8") == 1


def test_429_counts_every_prompt_of_the_batch_as_overloaded():
    c, _ = make_client(seconds=0.6, max_in_flight=2, composition=(8,))
    with c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(c.post, "/v1/completions", json={"prompt": [1, 2, 3]})
        wait_until(lambda: c.get("/v1/workers").json()["workers"][0]["running"])
        refused = c.post("/v1/completions", json={"prompt": [[4, 5], [6, 7]]})
        assert refused.status_code == 429 and first.result().status_code == 200
        _, s = _scrape(c)
    assert _value(s, "vertumnus:request_rejected_total", model_name="tiny",
                  reason="overloaded") == 2
    assert _value(s, "vertumnus:request_success_total") == 1
    assert sum(x.value for x in s if x.name == "vertumnus:request_rejected_total") == 2


def test_auth_refusals_counted_by_reason():
    client, _ = make_client(api_key="k", admin_api_key=None)
    key = {"Authorization": "Bearer k"}
    with client:
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 401
        assert client.post("/v1/completions", json={"prompt": "a"},
                           headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post("/v1/workers/split", json={"worker_id": 0},
                           headers=key).status_code == 403
        text = client.get("/metrics", headers=key).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert _value(samples, "vertumnus:request_rejected_total", reason="unauthorized") == 2
    assert _value(samples, "vertumnus:request_rejected_total", reason="forbidden") == 1
