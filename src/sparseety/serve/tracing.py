"""Which requests are traced, at what tier, and handing their results to the store's ``TraceWriter``.

Sampling hashes the request id (:func:`sparseety.store.should_sample`), so every component agrees on
the same requests. Sampled requests run at the server's tier (2 by default), forced ones at tier 3,
the rest at tier 1 (counts and timings only: one ``requests`` row each). Trace records carry OpenTelemetry GenAI
attribute names under ``extra["otel"]``; with an OTLP endpoint each request is also exported as a span.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sparseety.engine.result import RunResult
from sparseety.errors import ConfigError
from sparseety.serve.config import ServeConfig

UNTRACED_TIER = 1
_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceDecision:
    """How one request is recorded: ``tier`` of its run, ``reason`` ``sampled``/``forced`` or None."""

    tier: int
    reason: str | None

    @property
    def traced(self) -> bool:
        return self.reason is not None


def genai_attributes(result: RunResult, *, operation: str, request_model: str, finish_reason: str,
                     max_tokens: int, temperature: float | None, top_p: float | None,
                     decision: TraceDecision, ttft_s: float | None, e2e_s: float) -> dict[str, Any]:
    """OpenTelemetry GenAI semantic-convention attributes plus SparSEEty's under ``sparseety.``."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "sparseety",
        "gen_ai.request.model": request_model,
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.request.top_p": top_p,
        "gen_ai.response.id": result.request_id,
        "gen_ai.response.model": result.model,
        "gen_ai.response.finish_reasons": [finish_reason],
        "gen_ai.usage.input_tokens": len(result.prompt_ids),
        "gen_ai.usage.output_tokens": len(result.output_ids),
        "sparseety.policy": result.policy,
        "sparseety.budget": result.budget,
        "sparseety.tier": result.tier,
        "sparseety.trace_reason": decision.reason,
        "sparseety.evicted_positions": result.evicted_positions,
        "sparseety.eviction_events": result.eviction_events,
        "sparseety.kv_cache_bytes_peak": result.kv_cache_bytes_peak,
        "sparseety.kv_cache_bytes_dense": result.kv_cache_bytes_dense,
        "sparseety.draft_rejected": result.draft_rejected,
        "sparseety.time_to_first_token_s": ttft_s,
        "sparseety.e2e_latency_s": e2e_s,
    }
    return {key: value for key, value in attributes.items() if value is not None}


def _span_exporter(endpoint: str) -> Any:
    """A tracer provider exporting over OTLP/HTTP; a clear error when the SDK is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(
            "--otlp-endpoint needs the OpenTelemetry SDK and its OTLP exporter: "
            "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": "sparseety"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class Tracer:
    """Sampling decisions, the store's writer and the optional span exporter of one server."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.writer: Any = None
        self._last_logged: str | None = None
        self._provider: Any = _span_exporter(config.otlp_endpoint) if config.otlp_endpoint else None
        if config.trace_dir is not None:
            from sparseety.store import TraceWriter
            from sparseety.store.dataset import check_trace_dir

            check_trace_dir(config.trace_dir)  # an unwritable store fails at start-up, not request by request
            self.writer = TraceWriter(config.trace_dir, queue_size=config.trace_queue_size,
                                      redact=config.redact, ids_only=config.ids_only, on_error=self._write_failed)

    def _write_failed(self, exc: BaseException, request_ids: list[str]) -> None:
        """Log a write failure once (again only when the error changes); every one is counted by the writer."""
        message = f"{type(exc).__name__}: {exc}"
        if message != self._last_logged:
            self._last_logged = message
            _LOG.error("traces of %d request(s) not written to %s: %s (the answers were returned; further "
                       "failures like this one are only counted in sparseety:trace_records_dropped)",
                       len(request_ids), self.config.trace_dir, message)

    @property
    def enabled(self) -> bool:
        """Whether traces are stored (a trace directory is configured)."""
        return self.writer is not None

    def decide(self, request_id: str, *, force: bool, tier: int | None) -> TraceDecision:
        """Forced requests get ``tier`` or 3, sampled ones ``tier`` or the server's, the rest tier 1."""
        if not self.enabled:
            return TraceDecision(UNTRACED_TIER, None)
        if force:
            return TraceDecision(tier or 3, "forced")
        from sparseety.store import should_sample

        if should_sample(request_id, self.config.sample_rate):
            return TraceDecision(tier or self.config.tier, "sampled")
        return TraceDecision(UNTRACED_TIER, None)

    def submit(self, result: RunResult, decision: TraceDecision, extra: dict[str, Any]) -> bool:
        """Hand a result to the writer without waiting; False when it was dropped (and counted)."""
        rate = 1.0 if decision.reason == "forced" else self.config.sample_rate
        return bool(self.writer.submit(result, sample_rate=rate, extra=extra))

    def export_span(self, attributes: dict[str, Any], start_ns: int, end_ns: int) -> None:
        """Export one request as a span (no-op without an OTLP endpoint)."""
        if self._provider is None:
            return
        from opentelemetry.trace import SpanKind

        name = f"{attributes['gen_ai.operation.name']} {attributes['gen_ai.request.model']}"
        span = self._provider.get_tracer("sparseety.serve").start_span(
            name, kind=SpanKind.SERVER, start_time=start_ns, attributes=attributes)
        span.end(end_time=end_ns)

    def stats(self) -> Any:
        """The writer's statistics, or None when tracing is off."""
        return self.writer.stats() if self.writer is not None else None

    def close(self) -> None:
        """Flush and stop the writer and the exporter."""
        if self.writer is not None:
            self.writer.close()
        if self._provider is not None:
            self._provider.shutdown()
