"""The API server's readers: the frontend's output loop, the stat logger, the request-arg checks; each turns a
vLLM object into SparSEEty's own type."""

from __future__ import annotations

import os
import time
from typing import Any

from sparseety.integrations.vllm.vllm_api.guards import hook_off
from sparseety.integrations.vllm.vllm_api.needs import resolve
from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest, FinishedStats, ServedConfig


# -- API server: the frontend's output loop ---------------------------------------------------------------
_PREEMPTED = "_sparseety_preempted"  #: the marks SparSEEty keeps on a vLLM RequestState


def is_preemption(event: Any, preempted: Any) -> bool:
    return event.type == preempted


def output_events(engine_core_output: Any) -> Any:
    """The events of one ``EngineCoreOutput`` (None for most steps)."""
    return getattr(engine_core_output, "events", None)


def preempted_type() -> Any:
    from vllm.v1.engine import EngineCoreEventType

    return EngineCoreEventType.PREEMPTED


def mark_preempted(req_state: Any) -> None:
    """Note on ``req_state`` how many output tokens it had when vLLM preempted it."""
    detok = req_state.detokenizer
    marks = getattr(req_state, _PREEMPTED, None)
    if marks is None:
        marks = []
        setattr(req_state, _PREEMPTED, marks)
    marks.append(detok.num_output_tokens() if detok is not None else 0)


def finished_request(req_state: Any, finish_reason: Any) -> FinishedRequest:
    """What the frontend's ``RequestState`` knows of a finished request."""
    from sparseety.integrations.vllm.vllm_api.ids import external_id

    detok = req_state.detokenizer
    spec = req_state.spec_decode_metrics
    choice = None
    row_id = req_state.external_req_id
    if req_state.parent_req is not None:  # one of n > 1 choices: vLLM's child id is ``<index>_<parent id>``
        row_id = external_id(req_state.request_id)
        head = row_id.partition("_")[0]
        choice = int(head) if head.isdigit() else None
    return FinishedRequest(
        request_id=row_id,
        join_id=req_state.external_req_id,
        choice=choice,
        internal_id=req_state.request_id,
        prompt_ids=list(req_state.prompt_token_ids or ()),
        output_ids=list(detok.output_token_ids) if detok is not None else [],
        text=getattr(detok, "output_text", "") or "",  # only a detokenizing request has text
        num_cached_tokens=int(req_state.num_cached_tokens or 0),
        preempted_at=list(getattr(req_state, _PREEMPTED, ())),
        per_step_drafted=list(spec.per_step_drafted) if spec is not None and spec.per_step_drafted else None,
        per_step_accepted=list(spec.per_step_accepted) if spec is not None and spec.per_step_accepted else None,
        num_draft_tokens=int(spec.num_draft_tokens) if spec is not None else 0,
        num_accepted_tokens=sum(j * c for j, c in enumerate(spec.histogram)) if spec is not None else 0,
        finish_reason=reason(finish_reason),
    )


def aborting(output_processor: Any, request_ids: Any) -> list[Any]:
    """The ``RequestState`` s that ``abort_requests(request_ids)`` is about to drop: by internal id, or every
    request of an external id (a parent of ``n > 1`` choices aborts its children through a call of its own)."""
    states = output_processor.request_states
    found = []
    for rid in request_ids:
        if rid in states:
            found.append(states[rid])
        else:
            found += [states[i] for i in output_processor.external_req_ids.get(rid, ()) if i in states]
    return found


def reason(finish_reason: Any) -> str | None:
    """vLLM's finish reason (an enum or a string) as lower-case text."""
    if finish_reason is None:
        return None
    return finish_reason.name.lower() if hasattr(finish_reason, "name") else str(finish_reason).lower()


def aborted_request(req_state: Any) -> FinishedRequest:
    """A request ``abort_requests`` dropped unfinished: what it produced, ``finish_reason`` ``abort``, and the
    times and preemptions vLLM's ``RequestStateStats`` hold for it (vLLM makes no ``FinishedRequestStats`` of an
    aborted request; the times are those it would have computed, each one only once its stamps are set)."""
    request = finished_request(req_state, "abort")
    stats = req_state.stats  # None when vLLM logs no stats
    if stats is None:
        return request
    request.num_preemptions = int(stats.num_preemptions)
    queued, scheduled, first, last = (float(stats.queued_ts), float(stats.scheduled_ts),
                                      float(stats.first_token_ts), float(stats.last_token_ts))
    timings: dict[str, float] = {}
    if stats.arrival_time:
        timings["e2e_s"] = max(0.0, time.time() - float(stats.arrival_time))
    if scheduled and queued:
        timings["queued_s"] = scheduled - queued
    if first and scheduled:
        timings["prefill_s"] = first - scheduled
    if last and first:
        timings["decode_s"] = last - first
    if last and scheduled:
        timings["inference_s"] = last - scheduled
    request.timings = timings
    return request


# -- API server: the stat logger ---------------------------------------------------------------------------
def stat_logger_base() -> type:
    """vLLM's ``StatLoggerBase`` (ImportError, after one warning, when it is gone)."""
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:
        hook_off("stat-logger", "vllm.v1.metrics.loggers.StatLoggerBase")
        raise
    return StatLoggerBase


def finished_stats(iteration_stats: Any) -> list[FinishedStats]:
    """The requests one engine step finished, as vLLM's ``FinishedRequestStats`` tell them."""
    if iteration_stats is None:
        return []
    return [FinishedStats(request_id=f.request_id, finish_reason=reason(f.finish_reason),
                          num_cached_tokens=int(f.num_cached_tokens), num_preemptions=int(f.num_preemptions),
                          timings={"e2e_s": float(f.e2e_latency), "queued_s": float(f.queued_time),
                                   "prefill_s": float(f.prefill_time), "decode_s": float(f.decode_time),
                                   "inference_s": float(f.inference_time)})
            for f in iteration_stats.finished_requests]


def recomputed_tokens(scheduler_stats: Any) -> int | None:
    """Prompt tokens resumed (preempted) requests prefilled again in this step (None: no cache stats)."""
    stats = getattr(scheduler_stats, "prefix_cache_stats", None)
    if stats is None:
        return None
    return int(stats.preempted_queries) - int(stats.preempted_hits)


def kv_endpoint(vllm_config: Any) -> str | None:
    """The ZMQ endpoint vLLM publishes KV events on (None when it publishes none, or its config changed)."""
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if kv_events is None:
        return None
    missing = [f for f in ("enable_kv_cache_events", "publisher", "endpoint") if not hasattr(kv_events, f)]
    if missing:
        hook_off("kv-events", f"{type(kv_events).__name__}.{missing[0]}")
        return None
    if kv_events.enable_kv_cache_events and kv_events.publisher == "zmq":
        return str(kv_events.endpoint)
    return None


def api_server_index(parallel_config: Any) -> int:
    """This API server's index among ``--api-server-count`` of them (vLLM's client index, which it
    routes each request's outputs by; ``ParallelConfig._api_process_rank``, 0 with one API server)."""
    index = getattr(parallel_config, "_api_process_rank", 0)
    return int(index) if isinstance(index, int) and index > 0 else 0


def served_name(model_config: Any) -> str:
    """The name clients use for the model: ``--served-model-name`` (vLLM's first one). Without it vLLM
    serves the model argument itself; when that is a local directory, the trace names the model by the
    directory's name (a Hugging Face cache snapshot by its repository id), not the whole path."""
    name = str(model_config.served_model_name or model_config.model)
    path = str(model_config.model)
    if name != path or not os.path.isdir(path):
        return name
    parts = os.path.normpath(path).split(os.sep)
    for part in parts:
        if part.startswith("models--"):  # .../hub/models--ORG--NAME/snapshots/REVISION
            return part.removeprefix("models--").replace("--", "/")
    return parts[-1] or name


def served_config(vllm_config: Any, *, kv_events: bool = True) -> ServedConfig:
    """What the stat logger records about the served model (``kv_events``: read the KV-event endpoint)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    spec = getattr(vllm_config, "speculative_config", None)
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    return ServedConfig(
        model=served_name(model_config),
        tokenizer=str(getattr(model_config, "tokenizer", None) or model_config.model),
        model_path=str(model_config.model),
        block_size=cache_config.block_size if cache_config.enable_prefix_caching else None,
        kv_endpoint=kv_endpoint(vllm_config) if kv_events else None,
        data_parallel_size=dp,
        api_server=api_server_index(parallel),
        config={
            "block_size": cache_config.block_size,
            "enable_prefix_caching": bool(cache_config.enable_prefix_caching),
            "speculative_method": getattr(spec, "method", None) if spec is not None else None,
            "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) if spec else None,
            "max_model_len": model_config.max_model_len,
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "data_parallel_size": dp,
            "api_server_count": int(getattr(parallel, "_api_process_count", 1) or 1),
        },
    )


# -- API server: the request-arg checks ----------------------------------------------------------------------
def validation_error() -> Any:
    """vLLM's ``VLLMValidationError`` (``(message, parameter=...)``; vLLM answers it with HTTP 400)."""
    return resolve("vllm.exceptions:VLLMValidationError")


def sampling_extra_args(params: Any) -> Any:
    """A request's ``SamplingParams.extra_args`` (``vllm_xargs``), or None (pooling params have none)."""
    return getattr(params, "extra_args", None)


def add_inner_middleware(app: Any, cls: type, *args: Any) -> None:
    """Add ASGI middleware ``cls(app, *args)`` innermost in vLLM's FastAPI ``app``: after its CORS and
    authentication middleware, so a client that is not let in learns nothing from it."""
    middleware = resolve("starlette.middleware:Middleware")
    app.user_middleware.append(middleware(cls, *args))
