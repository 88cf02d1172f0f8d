"""Prometheus metrics of the live pool (prometheus-client), drop-in with vLLM v1's.

Where vLLM has the concept, the series has vLLM's name with `vllm:` replaced by `vertumnus:`,
vLLM's labels (`model_name`, the first served model name; `engine`, always "0": one scheduler)
and vLLM's buckets (`vllm/v1/metrics/loggers.py`), so a vLLM dashboard works after the prefix is
replaced. Pool-wide gauges (`num_requests_running` / `_waiting`, `kv_cache_usage_perc`) are one
series for the whole pool; the per-worker detail has names of our own (`vertumnus:worker_*`,
labels `worker_id`, `cp_degree`). Our own series carry `model_name` too.

Event metrics are updated as requests end (`ServingMetrics.observe`); state metrics are read from
the engine when `/metrics` is scraped, by a custom collector, so a worker that left the pool
leaves no stale series. Each `ServingMetrics` has its own `CollectorRegistry` (several engines may
live in one process, e.g. in tests). `DASHBOARD` is a Grafana dashboard over these series
(`tests/serving/test_metrics_names.py` checks that every series it queries is exported).

Labels: M = `model_name`, E = `engine`. Times in seconds, from the request's arrival.

| metric | type | labels | what |
| --- | --- | --- | --- |
| `vertumnus:time_to_first_token_seconds` | histogram | M, E | TTFT (vLLM's TTFT buckets) |
| `vertumnus:e2e_request_latency_seconds` | histogram | M, E | arrival to the request's end (max_tokens=1: TTFT plus the hand-off) |
| `vertumnus:request_queue_time_seconds` | histogram | M, E | arrival to the start of its prefill on the worker |
| `vertumnus:request_prefill_time_seconds` | histogram | M, E | prefill on the worker |
| `vertumnus:request_prompt_tokens`, `..._generation_tokens` | histogram | M, E | tokens per request (1-2-5 buckets up to max_model_len) |
| `vertumnus:prompt_tokens_total`, `vertumnus:generation_tokens_total` | counter | M, E | tokens (one generated token per request) |
| `vertumnus:prefix_cache_queries_total`, `..._hits_total` | counter | M, E | prompt tokens looked up / served from the prefix cache |
| `vertumnus:request_success_total` | counter | M, E, finished_reason | requests answered (`length`: max_tokens=1) |
| `vertumnus:num_requests_running` | gauge | M, E | prefills running in the pool |
| `vertumnus:num_requests_waiting` | gauge | M, E | requests admitted, not started (queued on a worker or waiting for one) |
| `vertumnus:kv_cache_usage_perc` | gauge | M, E | KV blocks held by the prefix caches / all KV blocks of the pool, in [0, 1] |
| `vertumnus:request_failure_total` | counter | M | failed prefills (HTTP 500; 503 when the host running it was lost) |
| `vertumnus:request_aborted_total` | counter | M, reason | requests withdrawn before they started: `client_disconnected` |
| `vertumnus:request_rejected_total` | counter | M, reason | prompts refused: `overloaded` (429), `shutting_down` (503, at admission or at the shutdown deadline), `no_worker_fits` (503) (a batch counts each prompt); HTTP requests refused: `body_too_large` (413), `body_timeout` (408), `unauthorized` (401), `forbidden` (403); `kv_hold_conflict` (409, a reused request id whose KV is still held) |
| `vertumnus:worker_num_requests_running`, `..._waiting` | gauge | M, worker_id, cp_degree | per worker |
| `vertumnus:worker_kv_cache_usage_perc`, `vertumnus:worker_kv_cache_usage_blocks` | gauge | M, worker_id, cp_degree | per worker: fraction in [0, 1], blocks |
| `vertumnus:worker_epoch` | gauge | M, worker_id, cp_degree, status | epoch a worker was created under |
| `vertumnus:workers` | gauge | M, cp_degree | workers per CP degree (the composition) |
| `vertumnus:epoch` | gauge | M | the pool's current epoch |
| `vertumnus:reconfigurations_in_progress` | gauge | M, kind | splits / merges draining or re-carving |
| `vertumnus:reconfigurations_total` | counter | M, kind | splits / merges finished |
| `vertumnus:replications_total`, `vertumnus:reclamations_total` | counter | M | prefix copies / reclamations confirmed |
| `vertumnus:kv_holds`, `vertumnus:kv_hold_blocks` | gauge | M | P/D hand-off: prompts whose KV is held for a decode side; blocks they pin (`serving.kv_hold`) |
| `vertumnus:kv_holds_created_total`, `vertumnus:kv_holds_offloaded_total` | counter | M | holds created; holds moved to host memory before a split or merge |
| `vertumnus:kv_holds_released_total` | counter | M, reason | holds ended: pulled, released, expired, preempted, failed, host_lost |
| `process_*`, `python_*` | | | prometheus-client's process, platform and GC collectors (as vLLM exports) |
"""

from __future__ import annotations

import pathlib
from collections import Counter as _Tally

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, Counter, Histogram, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.kv_hold import RELEASE_REASONS

# The Grafana dashboard over these series (Grafana 10 model, `${DS_PROMETHEUS}` input).
DASHBOARD = pathlib.Path(__file__).parent / "grafana" / "vertumnus-dashboard.json"

# vLLM's TTFT buckets (`vllm:time_to_first_token_seconds`), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's `request_latency_buckets` (e2e, queue, prefill), seconds.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ENGINE = "0"  # vLLM's `engine` label: the index of the engine core; the pool has one scheduler
FINISHED_REASON = "length"  # every answer ends after its first token (max_tokens=1)
REJECT_REASONS = ("overloaded", "shutting_down", "no_worker_fits", "body_too_large",
                  "body_timeout", "unauthorized", "forbidden", "kv_hold_conflict")
ABORT_REASONS = ("client_disconnected",)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value` (inclusive)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def abort_reason(error: str | None) -> str:
    """The `reason` label of an aborted request from its record's error."""
    return "client_disconnected" if error and "client disconnected" in error else "other"


class _Bound:
    """A labelled metric with its leading label values (e.g. `model_name`) fixed:
    `labels(reason)` is `metric.labels(model_name, reason)`."""

    def __init__(self, metric, *values: str):
        self.metric, self.values = metric, values

    def labels(self, *values: str):
        return self.metric.labels(*self.values, *values)


class _PoolCollector:
    """The state metrics, read from the engine at scrape time."""

    def __init__(self, engine, model_name: str):
        self._engine, self._model = engine, model_name

    def describe(self):
        return []

    def collect(self):
        m, e = self._model, ENGINE
        pool = ["model_name", "engine"]
        per = ["model_name", "worker_id", "cp_degree"]

        def gauge(name, doc, labels):
            return GaugeMetricFamily(name, doc, labels=labels)

        running = gauge("vertumnus:num_requests_running", "Prefills running in the pool.", pool)
        waiting = gauge("vertumnus:num_requests_waiting", "Requests admitted and not started "
                        "(queued on a worker or waiting for one).", pool)
        perc = gauge("vertumnus:kv_cache_usage_perc", "KV-cache usage of the pool: blocks held "
                     "by the workers' prefix caches over all their blocks (1 = 100 percent).",
                     pool)
        w_running = gauge("vertumnus:worker_num_requests_running", "Prefills running on a "
                          "worker (0 or 1).", per)
        w_waiting = gauge("vertumnus:worker_num_requests_waiting", "Requests queued on a worker "
                          "(not started).", per)
        w_perc = gauge("vertumnus:worker_kv_cache_usage_perc", "Fraction of a worker's KV blocks "
                       "held by its prefix cache, in [0, 1].", per)
        w_blocks = gauge("vertumnus:worker_kv_cache_usage_blocks", "KV blocks held by a worker's "
                         "prefix cache.", per)
        w_epoch = gauge("vertumnus:worker_epoch", "Epoch a worker was created under.",
                        per + ["status"])
        workers = gauge("vertumnus:workers", "Workers per CP degree (the composition).",
                        ["model_name", "cp_degree"])
        epoch = gauge("vertumnus:epoch", "The pool's current epoch.", ["model_name"])
        moving = gauge("vertumnus:reconfigurations_in_progress", "Splits and merges draining or "
                       "re-carving.", ["model_name", "kind"])
        recs = CounterMetricFamily("vertumnus:reconfigurations", "Finished splits and merges.",
                                   labels=["model_name", "kind"])
        reps = CounterMetricFamily("vertumnus:replications", "Finished prefix copies.",
                                   labels=["model_name"])
        recl = CounterMetricFamily("vertumnus:reclamations", "Confirmed prefix reclamations.",
                                   labels=["model_name"])
        errs = CounterMetricFamily("vertumnus:policy_errors", "Errors of the policy's router, "
                                   "hooks or dispatch that did not stop the step making them "
                                   "(each logged as a warning).", labels=["model_name"])
        s = self._engine.scheduler
        rows = self._engine.workers() if s is not None else []
        busy = sum(1 for w in rows if w["running"])
        cached = sum(w["kv_blocks_cached"] for w in rows)
        total = sum(w["kv_blocks_total"] for w in rows)
        running.add_metric([m, e], busy)
        waiting.add_metric([m, e], max(0, s.num_in_flight - busy) if s is not None else 0)
        perc.add_metric([m, e], cached / total if total else 0.0)
        for w in rows:
            lv = [m, str(w["worker_id"]), str(w["cp_degree"])]
            w_running.add_metric(lv, int(w["running"]))
            w_waiting.add_metric(lv, w["queued_requests"])
            w_perc.add_metric(lv, w["kv_blocks_cached"] / max(1, w["kv_blocks_total"]))
            w_blocks.add_metric(lv, w["kv_blocks_cached"])
            w_epoch.add_metric(lv + [w["status"]], w["epoch"])
        for c, n in sorted(_Tally(w["cp_degree"] for w in rows).items()):
            workers.add_metric([m, str(c)], n)
        finished = s.reconfig.finished if s is not None else _Tally()
        draining = _Tally(r.kind for r in s.reconfig.in_progress.values()) if s is not None \
            else _Tally()
        for kind in ("split", "merge"):
            recs.add_metric([m, kind], finished.get(kind, 0))
            moving.add_metric([m, kind], draining.get(kind, 0))
        epoch.add_metric([m], s.epoch if s is not None else 0)
        reps.add_metric([m], s.copies.num_copies if s is not None else 0)
        recl.add_metric([m], s.copies.num_reclaims if s is not None else 0)
        errs.add_metric([m], s.membership.num_errors if s is not None else 0)
        yield from (running, waiting, perc, w_running, w_waiting, w_perc, w_blocks, w_epoch,
                    workers, epoch, moving, recs, reps, recl, errs)
        yield from _hold_metrics(self._engine.handoff if s is not None else None, m)


def _hold_metrics(handoff, m: str):
    """The P/D hand-off's KV holds (`serving.kv_hold`); zeros when the backend holds none."""
    active = GaugeMetricFamily("vertumnus:kv_holds", "Prompts whose KV is held for a decode "
                               "side now.", labels=["model_name"])
    blocks = GaugeMetricFamily("vertumnus:kv_hold_blocks", "KV blocks pinned by holds (device "
                               "memory; offloaded holds excluded).", labels=["model_name"])
    created = CounterMetricFamily("vertumnus:kv_holds_created", "KV holds created "
                                  "(do_remote_decode requests that finished).",
                                  labels=["model_name"])
    ended = CounterMetricFamily("vertumnus:kv_holds_released", "KV holds ended, by reason: "
                                "pulled, released, expired, preempted, failed, host_lost.",
                                labels=["model_name", "reason"])
    offloaded = CounterMetricFamily("vertumnus:kv_holds_offloaded", "KV holds copied to host "
                                    "memory before their worker was split or merged.",
                                    labels=["model_name"])
    holds = handoff.holds if handoff is not None else None
    active.add_metric([m], len(holds) if holds is not None else 0)
    blocks.add_metric([m], sum(holds.held_blocks().values()) if holds is not None else 0)
    created.add_metric([m], holds.created if holds is not None else 0)
    for reason in RELEASE_REASONS:
        ended.add_metric([m, reason], holds.released[reason] if holds is not None else 0)
    offloaded.add_metric([m], holds.offloaded if holds is not None else 0)
    yield from (active, blocks, created, ended, offloaded)


class ServingMetrics:
    """The pool's Prometheus registry.

    Args:
      engine: the `serving.engine.Engine` whose state is read at scrape time.
      model_name: the `model_name` label of every series (the first served model name).

    Attributes:
      rejected: `rejected.labels(reason).inc(n)` counts `n` refusals (`REJECT_REASONS`).
      aborted: `aborted.labels(reason).inc()` counts a withdrawn request (`ABORT_REASONS`).
    """

    def __init__(self, engine, model_name: str = "vertumnus"):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        pool = ["model_name", "engine"]
        me = (model_name, ENGINE)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, pool, buckets=buckets, registry=r).labels(*me)

        def counter(name, doc):
            return Counter(name, doc, pool, registry=r).labels(*me)

        self.ttft = histogram("vertumnus:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.e2e = histogram("vertumnus:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vertumnus:request_queue_time_seconds",
                               "Histogram of time a request waited for its worker in seconds.",
                               REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vertumnus:request_prefill_time_seconds",
                                 "Histogram of time spent in prefill on the worker in seconds.",
                                 REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max(1, engine.config.max_model_len))
        self.request_prompt_tokens = histogram("vertumnus:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vertumnus:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.prompt_tokens = counter("vertumnus:prompt_tokens",
                                     "Number of prefill tokens processed.")
        self.generation_tokens = counter("vertumnus:generation_tokens",
                                         "Number of generation tokens processed.")
        self.cache_queries = counter("vertumnus:prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.")
        self.cache_hits = counter("vertumnus:prefix_cache_hits",
                                  "Prefix cache hits, in terms of number of cached tokens.")
        self.success = Counter("vertumnus:request_success",
                               "Count of successfully processed requests.",
                               pool + ["finished_reason"], registry=r).labels(*me,
                                                                              FINISHED_REASON)
        self.failure = Counter("vertumnus:request_failure", "Requests whose prefill failed.",
                               ["model_name"], registry=r).labels(model_name)
        self.aborted = _Bound(Counter(
            "vertumnus:request_aborted", "Requests withdrawn before they started, by reason "
            "(client_disconnected).", ["model_name", "reason"], registry=r), model_name)
        self.rejected = _Bound(Counter(
            "vertumnus:request_rejected", "Prompts refused: overloaded (429), shutting_down "
            "(503 at admission or at the shutdown deadline), no_worker_fits (503); HTTP "
            "requests refused: body_too_large (413), body_timeout (408), unauthorized (401), "
            "forbidden (403); kv_hold_conflict (409: the request id's KV is still held).",
            ["model_name", "reason"], registry=r), model_name)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for reason in ABORT_REASONS:
            self.aborted.labels(reason)
        r.register(_PoolCollector(engine, model_name))
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)  # process_*, python_info, python_gc_* (as vLLM exports)

    def observe(self, completion) -> None:
        """Counts one finished request (`serving.engine.Completion`)."""
        record = completion.record
        if record.aborted:
            self.aborted.labels(abort_reason(record.error)).inc()
            return
        if not record.ok and record.worker_id is None:  # valid, no worker of the pool fits
            self.rejected.labels("no_worker_fits").inc()
            return
        if not record.ok:
            self.failure.inc()
            return
        request = record.request
        self.success.inc()
        self.ttft.observe(completion.ttft_seconds)
        ends = [t for t in (record.first_token_time, record.finish_time) if t is not None]
        self.e2e.observe(max(0.0, max(ends) - request.arrival_time))
        self.queue.observe(completion.queue_seconds)
        self.prefill.observe(completion.prefill_seconds)
        self.request_prompt_tokens.observe(request.input_len)
        self.request_generation_tokens.observe(1)
        self.prompt_tokens.inc(request.input_len)
        self.generation_tokens.inc(1)
        self.cache_queries.inc(request.input_len)
        self.cache_hits.inc(record.cached_len)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
