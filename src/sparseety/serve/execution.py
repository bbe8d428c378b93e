"""What happens when a generation finishes (count, trace) and the response bodies."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sparseety.engine import RunResult, SparseEngine
from sparseety.serve.health import extraction_health
from sparseety.serve.metrics import ServeMetrics
from sparseety.serve.planning import Plan
from sparseety.serve.tracing import Tracer, genai_attributes

if TYPE_CHECKING:
    from sparseety.serve.engine_loop import TokenTimes


@dataclass(frozen=True)
class Outcome:
    """A finished generation and why it stopped (``stop``: end of sequence, ``length``: max_tokens)."""

    result: RunResult
    finish_reason: str


def finish(plan: Plan, result: RunResult, reason: str, times: TokenTimes, *, admitted: float | None,
           finished: float, engine: SparseEngine, tracer: Tracer, metrics: ServeMetrics, top_k: int) -> None:
    """Count a finished generation and hand it to the store (runs on the engine loop's thread).

    With a trace directory every request leaves a tier-1 row at least; the sampled and forced their
    full trace at their tier.
    """
    first = times.first
    metrics.observe_run(result, reason, arrival=plan.arrival, started=plan.arrival if admitted is None else admitted,
                        finished=finished, first_token=first, gaps=times.gaps())
    attributes = genai_attributes(
        result, operation=plan.operation, request_model=plan.request_model, finish_reason=reason,
        max_tokens=plan.max_tokens, temperature=plan.temperature, top_p=plan.top_p, decision=plan.decision,
        ttft_s=None if first is None else first - plan.arrival, e2e_s=finished - plan.arrival,
    )
    if tracer.enabled:  # tier 1 (counts and timings) for every request, more for the sampled and forced
        extra: dict[str, Any] = {"otel": attributes}
        if plan.decision.traced:
            metrics.trace_sampled.labels(plan.decision.reason).inc()
            special = tuple(getattr(engine.tokenizer, "all_special_ids", ()) or ())
            health = extraction_health(result, special, top_k) if result.tier >= 2 else None
            if health is not None:
                metrics.observe_health(health)
                extra["extraction_health"] = {**asdict(health), "adjacent_overlap": {
                    str(layer): value for layer, value in health.adjacent_overlap.items()}}
        if tracer.submit(result, plan.decision, extra):
            metrics.trace_traced.inc()
    tracer.export_span(attributes, plan.arrival_ns, time.time_ns())


def usage(result: RunResult) -> dict[str, Any]:
    """OpenAI's usage block with ``sparsity``."""
    prompt, completion = len(result.prompt_ids), len(result.output_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "sparsity": {
            "policy": result.policy,
            "evicted_positions": result.evicted_positions,
            "eviction_events": result.eviction_events,
            "kv_cache_bytes_peak": result.kv_cache_bytes_peak,
            "kv_cache_bytes_dense": result.kv_cache_bytes_dense,
            "draft_rejected": result.draft_rejected,
            "pruned_tokens": result.pruned_tokens,
        },
    }


def response_body(plan: Plan, outcome: Outcome, model: str, created: int) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` or ``text_completion`` object."""
    result = outcome.result
    if plan.operation == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": result.text},
                                  "finish_reason": outcome.finish_reason, "logprobs": None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": outcome.finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": plan.request_id, "object": kind, "created": created, "model": model, "choices": [choice],
            "usage": usage(result)}


def stream_chunk(plan: Plan, model: str, created: int, *, text: str | None = None, role: bool = False,
                 finish: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    """One streamed chunk (``usage: null`` on content chunks when the caller asked for usage)."""
    if plan.operation == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    chunk: dict[str, Any] = {"id": plan.request_id, "object": kind, "created": created, "model": model,
                             "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(plan: Plan, result: RunResult, model: str, created: int) -> dict[str, Any]:
    """The last chunk under ``stream_options.include_usage``: no choices, the usage block."""
    kind = "chat.completion.chunk" if plan.operation == "chat" else "text_completion"
    return {"id": plan.request_id, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage(result)}
