"""Prometheus metrics of the live pool (prometheus-client), named after vLLM's.

Event metrics are updated as requests end (`ServingMetrics.observe`); state metrics (queue depth,
composition, epochs, cache use, reconfiguration and replication counts) are read from the engine
when `/metrics` is scraped, by a custom collector, so a worker that left the pool leaves no
stale series. Each `ServingMetrics` has its own `CollectorRegistry` (several engines may live in
one process, e.g. in tests).

| metric | type | labels | unit |
| --- | --- | --- | --- |
| `vertumnus:time_to_first_token_seconds` | histogram | | seconds |
| `vertumnus:queue_time_seconds`, `vertumnus:prefill_time_seconds` | histogram | | seconds |
| `vertumnus:request_success_total` | counter | | requests |
| `vertumnus:request_failure_total` | counter | | requests |
| `vertumnus:request_aborted_total` | counter | | requests withdrawn (client disconnected) |
| `vertumnus:request_rejected_total` | counter | reason | prompts refused (overloaded, shutting_down, no_worker_fits; a batch counts each prompt), HTTP requests refused (body_too_large, body_timeout) |
| `vertumnus:prompt_tokens_total` | counter | | tokens |
| `vertumnus:prefix_cache_queries_total`, `vertumnus:prefix_cache_hits_total` | counter | | tokens |
| `vertumnus:num_requests_waiting` | gauge | worker_id, cp_degree | requests (queued) |
| `vertumnus:num_requests_running` | gauge | worker_id, cp_degree | requests |
| `vertumnus:worker_epoch` | gauge | worker_id, cp_degree, status | epoch |
| `vertumnus:kv_cache_usage_blocks` | gauge | worker_id, cp_degree | blocks |
| `vertumnus:kv_cache_usage_perc` | gauge | worker_id, cp_degree | fraction of the worker's KV blocks held by its prefix cache, in [0, 1] (vLLM's name) |
| `process_*`, `python_*` | prometheus-client's process, platform and GC collectors | | |
| `vertumnus:workers` | gauge | cp_degree | workers (the composition) |
| `vertumnus:reconfigurations_total` | counter | kind | operations finished |
| `vertumnus:replications_total`, `vertumnus:reclamations_total` | counter | | operations |
"""

from __future__ import annotations

from collections import Counter as _Tally

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, Counter, Histogram, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's TTFT buckets (vllm/engine/metrics.py), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


REJECT_REASONS = ("overloaded", "shutting_down", "no_worker_fits", "body_too_large",
                  "body_timeout")


class _PoolCollector:
    def __init__(self, engine):
        self._engine = engine

    def describe(self):
        return []

    def collect(self):
        engine = self._engine
        labels = ["worker_id", "cp_degree"]
        waiting = GaugeMetricFamily("vertumnus:num_requests_waiting",
                                    "Requests queued on a worker (not started).", labels=labels)
        running = GaugeMetricFamily("vertumnus:num_requests_running",
                                    "Requests in prefill on a worker.", labels=labels)
        epoch = GaugeMetricFamily("vertumnus:worker_epoch", "Epoch a worker was created under.",
                                  labels=labels + ["status"])
        usage = GaugeMetricFamily("vertumnus:kv_cache_usage_blocks",
                                  "KV blocks held by a worker's prefix cache.", labels=labels)
        perc = GaugeMetricFamily("vertumnus:kv_cache_usage_perc",
                                 "Fraction of a worker's KV blocks held by its prefix cache, in "
                                 "[0, 1].", labels=labels)
        workers = GaugeMetricFamily("vertumnus:workers", "Workers per CP degree (composition).",
                                    labels=["cp_degree"])
        if engine.scheduler is not None:
            rows = engine.workers()
            for w in rows:
                lv = [str(w["worker_id"]), str(w["cp_degree"])]
                waiting.add_metric(lv, w["queued_requests"])
                running.add_metric(lv, int(w["running"]))
                epoch.add_metric(lv + [w["status"]], w["epoch"])
                usage.add_metric(lv, w["kv_blocks_cached"])
                perc.add_metric(lv, w["kv_blocks_cached"] / max(1, w["kv_blocks_total"]))
            for c, n in sorted(_Tally(w["cp_degree"] for w in rows).items()):
                workers.add_metric([str(c)], n)
        yield from (waiting, running, epoch, usage, perc, workers)
        recs = CounterMetricFamily("vertumnus:reconfigurations", "Finished splits and merges.",
                                   labels=["kind"])
        reps = CounterMetricFamily("vertumnus:replications", "Finished prefix copies.")
        recl = CounterMetricFamily("vertumnus:reclamations", "Confirmed prefix reclamations.")
        s = engine.scheduler
        kinds = s.reconfig.finished if s is not None else _Tally()
        for kind in ("split", "merge"):
            recs.add_metric([kind], kinds.get(kind, 0))
        reps.add_metric([], s.copies.num_copies if s is not None else 0)
        recl.add_metric([], s.copies.num_reclaims if s is not None else 0)
        yield from (recs, reps, recl)


class ServingMetrics:
    """The pool's Prometheus registry.

    Args:
      engine: the `serving.engine.Engine` whose state is read at scrape time.
    """

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("vertumnus:time_to_first_token_seconds",
                              "Time to first token (arrival to first token), seconds.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.queue = Histogram("vertumnus:queue_time_seconds",
                               "Time a request waited for its worker, seconds.",
                               buckets=TTFT_BUCKETS, registry=r)
        self.prefill = Histogram("vertumnus:prefill_time_seconds",
                                 "Prefill time on the worker, seconds.",
                                 buckets=TTFT_BUCKETS, registry=r)
        self.success = Counter("vertumnus:request_success", "Requests completed.", registry=r)
        self.failure = Counter("vertumnus:request_failure", "Requests that failed.", registry=r)
        self.aborted = Counter("vertumnus:request_aborted", "Requests withdrawn before they "
                               "started because their client disconnected.", registry=r)
        self.rejected = Counter(
            "vertumnus:request_rejected", "Prompts refused: overloaded (429), shutting_down "
            "(503 at admission or at the shutdown deadline), no_worker_fits (503); HTTP "
            "requests refused: body_too_large (413), body_timeout (408).",
            labelnames=["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.prompt_tokens = Counter("vertumnus:prompt_tokens", "Prompt tokens prefilled.",
                                     registry=r)
        self.cache_queries = Counter("vertumnus:prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.", registry=r)
        self.cache_hits = Counter("vertumnus:prefix_cache_hits",
                                  "Prompt tokens served from the prefix cache.", registry=r)
        r.register(_PoolCollector(engine))
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)  # process_*, python_info, python_gc_* (as vLLM exports)

    def observe(self, completion) -> None:
        """Counts one finished request (`serving.engine.Completion`)."""
        record = completion.record
        if record.aborted:
            self.aborted.inc()
            return
        if not record.ok and record.worker_id is None:  # valid, no worker of the pool fits
            self.rejected.labels("no_worker_fits").inc()
            return
        if not record.ok:
            self.failure.inc()
            return
        self.success.inc()
        self.ttft.observe(completion.ttft_seconds)
        self.queue.observe(completion.queue_seconds)
        self.prefill.observe(completion.prefill_seconds)
        self.prompt_tokens.inc(record.request.input_len)
        self.cache_queries.inc(record.request.input_len)
        self.cache_hits.inc(record.cached_len)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
