"""Prometheus metrics of one app, on its own registry (vLLM's names where vLLM has one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sparseety.engine.result import RunResult
from sparseety.serve.health import ExtractionHealth

P = "sparseety:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
FRACTION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
EXTRACTION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class _TraceWriterCollector(Collector):
    """Reads the trace writer's own counters at scrape time."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        if stats is None:
            return
        yield CounterMetricFamily(P + "trace_records_dropped", "Trace records the writer dropped (queue full or "
                                  "write error).", value=stats.dropped_records + stats.failed_records)
        yield CounterMetricFamily(P + "trace_records_committed", "Requests whose trace the writer committed.",
                                  value=stats.committed_requests)
        yield GaugeMetricFamily(P + "trace_queue_depth", "Trace records waiting in the writer's queue.",
                                value=stats.queue_depth)


class ServeMetrics:
    """Every metric ``/metrics`` exports; thread-safe (observed from worker threads)."""

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int],
                 writer_stats: Callable[[], Any] | None = None, reserved: Callable[[], int] | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=r)
        #: labelled ``finish_reason`` as vLLM's; ``finished_reason`` (the old name, the same value) is kept for this
        #: release only, so dashboards can move (docs/serving.md)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason.",
                                       ["finish_reason", "finished_reason"], registry=r)
        self.request_rejected = Counter(P + "request_rejected", "Requests refused before running, by reason.",
                                        ["reason"], registry=r)
        self.request_aborted = Counter(P + "request_aborted", "Generations stopped before the end, by reason.",
                                       ["reason"], registry=r)
        self.request_failed = Counter(P + "request_failed", "Requests that failed alone after admission (their "
                                      "neighbours ran on), by stage.", ["stage"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last generated token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Arrival to admission into the batch.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        Gauge(P + "num_requests_running", "Requests in the batch now (prefilling or decoding).",
              registry=r).set_function(running)
        Gauge(P + "num_requests_waiting", "Accepted requests waiting for a place in the batch.",
              registry=r).set_function(waiting)
        if reserved is not None:
            Gauge(P + "kv_cache_reserved_bytes", "Worst-case KV bytes reserved by the requests in the batch.",
                  registry=r).set_function(reserved)
        self.batch_size = Histogram(P + "batch_size", "Sequences in each engine step.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.step_prefill_tokens = Counter(P + "step_prefill_tokens", "Prompt tokens prefilled in engine steps.",
                                           registry=r)
        by_policy = ["policy"]
        self.evicted_positions = Counter(P + "evicted_positions", "Distinct positions evicted, summed over requests.",
                                         by_policy, registry=r)
        self.eviction_events = Counter(P + "eviction_events", "(layer, KV head, position) evictions.", by_policy,
                                       registry=r)
        self.kv_bytes_peak = Counter(P + "kv_cache_bytes_peak", "Peak KV-cache bytes held, summed over requests.",
                                     by_policy, registry=r)
        self.kv_bytes_dense = Counter(P + "kv_cache_bytes_dense", "KV-cache bytes a dense cache would have held, "
                                      "summed over requests.", by_policy, registry=r)
        self.kept_fraction = Histogram(P + "kv_cache_kept_fraction", "Peak KV bytes held / dense KV bytes, per "
                                       "request.", by_policy, buckets=FRACTION_BUCKETS, registry=r)
        self.draft_rejected = Counter(P + "draft_rejected_tokens", "Drafted tokens rejected.", by_policy, registry=r)
        self.top1_hit_rate = Histogram(P + "important_token_top1_hit_rate", "Share of layers whose top important "
                                       "token is the top token over all layers (traced requests).",
                                       buckets=FRACTION_BUCKETS, registry=r)
        self.layer_overlap = Histogram(P + "important_token_layer_overlap", "Overlap of the top-k important tokens "
                                       "of a layer and the next (traced requests).", ["layer"],
                                       buckets=(0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.filtered_ratio = Histogram(P + "importance_filtered_ratio", "Share of importance scores below "
                                        "min_score (traced requests).", buckets=FRACTION_BUCKETS, registry=r)
        self.extraction_latency = Histogram(P + "extraction_latency_seconds", "Time to extract the important-token "
                                            "rankings of a traced request.", buckets=EXTRACTION_BUCKETS, registry=r)
        self.trace_sampled = Counter(P + "trace_records_sampled", "Requests chosen for tracing, by reason "
                                     "(sampled or forced).", ["reason"], registry=r)
        self.trace_traced = Counter(P + "trace_records_traced", "Trace records the writer accepted.", registry=r)
        if writer_stats is not None:
            r.register(_TraceWriterCollector(writer_stats))

    def observe_run(self, result: RunResult, finish_reason: str, *, arrival: float, started: float,
                    finished: float, first_token: float | None, gaps: list[float]) -> None:
        """Count one finished generation (times are ``time.perf_counter`` values)."""
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.generation_tokens.inc(len(result.output_ids))
        self.request_success.labels(finish_reason, finish_reason).inc()
        self.queue_time.observe(started - arrival)
        self.e2e.observe(finished - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
        for gap in gaps:
            self.itl.observe(gap)
        policy = result.policy
        self.evicted_positions.labels(policy).inc(result.evicted_positions or 0)
        self.eviction_events.labels(policy).inc(result.eviction_events or 0)
        self.kv_bytes_peak.labels(policy).inc(result.kv_cache_bytes_peak)
        self.kv_bytes_dense.labels(policy).inc(result.kv_cache_bytes_dense)
        if result.kv_cache_bytes_dense > 0:
            self.kept_fraction.labels(policy).observe(result.kv_cache_bytes_peak / result.kv_cache_bytes_dense)
        self.draft_rejected.labels(policy).inc(result.draft_rejected)

    def observe_step(self, stats: Any) -> None:
        """Record one engine step (``StepStats``)."""
        if stats.batch_size:
            self.batch_size.observe(stats.batch_size)
        self.step_prefill_tokens.inc(stats.prefill_tokens)

    def observe_health(self, health: ExtractionHealth) -> None:
        """Record the extraction health of a traced request."""
        self.top1_hit_rate.observe(health.top1_hit_rate)
        for layer, overlap in health.adjacent_overlap.items():
            self.layer_overlap.labels(str(layer)).observe(overlap)
        self.filtered_ratio.observe(health.filtered_ratio)
        self.extraction_latency.observe(health.extraction_s)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
