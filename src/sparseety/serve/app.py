"""``create_app``: the OpenAI-compatible FastAPI app with ``/metrics`` and the trace endpoints.

Endpoints: ``GET /health``, ``GET /metrics`` (both open), ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (bearer key when one is configured), ``GET /v1/traces?limit=N`` and
``GET /v1/traces/{request_id}`` (only with a key and a trace store; 404 otherwise).

Headers: ``X-Request-Id`` names the request (response ``id``, sampling, trace lookup; echoed back);
``X-Sparseety-Trace: 1`` forces a tier-3 trace, like ``"sparsity": {"trace": true}`` in the body.
Generation is greedy (``temperature``/``top_p`` accepted, ``n`` must be 1) and continuously batched:
one engine loop thread owns the model (:mod:`sparseety.serve.engine_loop`); up to ``max_concurrency``
sequences decode together, admitted while their worst-case KV bytes fit under ``kv_memory_limit``,
``queue_capacity`` more wait, the rest get 429. Streams send each token when its step ends. A client
that leaves (stream or not) takes its request out of the batch at the next step and frees its KV
reservation. One id, one trace: a request whose ``X-Request-Id`` is running or stored gets 409
(:mod:`sparseety.serve.request_ids`). At shutdown (:meth:`ServerState.stop`) new requests get 503 and
running ones end with a 503 error (a JSON body, or an error event in a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from sparseety import __version__
from sparseety.engine import SparseEngine
from sparseety.errors import QueryLimitError, RecordError, SparseetyError
from sparseety.options import GenerationOptions
from sparseety.serve.auth import check_key, check_trace_access
from sparseety.serve.config import ServeConfig
from sparseety.serve.errors import APIError, error_body, install_error_handlers
from sparseety.serve.engine_loop import EngineLoop, QueueFull, RequestSink
from sparseety.serve.execution import (
    Outcome,
    finish,
    response_body,
    stream_chunk,
    usage_chunk,
)
from sparseety.serve.limits import BodySizeLimit
from sparseety.serve.metrics import ServeMetrics
from sparseety.serve.planning import Plan, check_request_id, plan_request, request_options
from sparseety.serve.request_ids import RequestIds, stored_request_ids
from sparseety.serve.schemas import (
    ERROR_RESPONSES,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    TraceList,
)
from sparseety.serve.tracing import Tracer

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <api key> (when the server has one)")
TRUE_HEADER = {"1", "true", "yes", "on"}
DISCONNECT_POLL_S = 0.2
"""How often a non-streaming request checks whether its client is still there."""
CLIENT_LEFT = 499
"""The status logged for a request whose client left before the answer (nobody receives it)."""


@dataclass
class ServerState:
    """Everything the routes share."""

    config: ServeConfig
    engine: SparseEngine
    loop: EngineLoop
    tracer: Tracer
    metrics: ServeMetrics
    created: int
    options: GenerationOptions  #: every request's defaults (:meth:`ServeConfig.generation_options`)
    ids: RequestIds
    stopping: bool = field(default=False)
    _closed: bool = field(default=False)

    def stop(self) -> None:
        """Shutdown has begun: new requests get 503, running ones fail at the end of the current step."""
        if not self.stopping:
            self.stopping = True
            threading.Thread(target=self.loop.shutdown, name="sparseety-stop", daemon=True).start()

    def close(self) -> None:
        """Stop the engine loop (waiting for its current step) and flush the trace writer; idempotent."""
        self.stopping = True
        if not self._closed:
            self._closed = True
            self.loop.shutdown()
            self.tracer.close()


def _shutting_down(running: bool) -> APIError:
    what = ("this request was stopped before it finished: send it again later" if running
            else "it takes no new requests")
    return APIError(503, f"the server is shutting down: {what}", code="server_shutting_down")


def _jsonable(value: Any) -> Any:
    """NumPy scalars to Python, NaN/inf to None (JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def create_app(config: ServeConfig, engine: SparseEngine | None = None) -> FastAPI:
    """Build the app (loading ``config.model`` unless an engine is given); start it with uvicorn.

    Raises :class:`~sparseety.errors.ConfigError` for a bad default policy or tracing setup.
    """
    state = _server_state(config, engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await anyio.to_thread.run_sync(state.close)

    app = FastAPI(title="SparSEEty", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible sparse serving; generation is greedy.")
    app.state.serve = state
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    install_error_handlers(app)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    _add_trace_routes(app, state)
    return app


def _server_state(config: ServeConfig, engine: SparseEngine | None) -> ServerState:
    """Check the default policy and the tracing setup, load the model unless given, build the engine loop."""
    config.generation_options()  # the default policy, before the model loads
    tracer = Tracer(config)  # before the model loads: a bad tracing setup fails fast
    if engine is None:
        from sparseety.models import load_model

        model, tokenizer = load_model(config.model)
        engine = SparseEngine(model, tokenizer, config.model)
    options = config.generation_options(engine)
    loop_ref: list[EngineLoop] = []
    metrics = ServeMetrics(lambda: loop_ref[0].running, lambda: loop_ref[0].waiting,
                           tracer.stats if tracer.enabled else None, reserved=lambda: loop_ref[0].batch.reserved_bytes)

    def finished(plan: Plan, result: Any, reason: str, sink: RequestSink, now: float) -> None:
        finish(plan, result, reason, sink.times, admitted=sink.admitted, finished=now, engine=engine, tracer=tracer,
               metrics=metrics, top_k=config.top_k)

    engine_loop = EngineLoop(
        engine, max_batch=config.max_concurrency, max_queue=config.queue_capacity, prefill_chunk=config.prefill_chunk,
        kv_memory_limit=config.kv_memory_limit, on_finish=finished,
        on_step=lambda batch: metrics.observe_step(batch.last_step),
        on_abort=lambda _: metrics.request_aborted.labels("client_disconnected").inc(),
        on_fail=lambda _, failure: metrics.request_failed.labels(failure.stage).inc())
    loop_ref.append(engine_loop)
    stored = stored_request_ids(config.trace_dir) if tracer.enabled and config.trace_dir is not None else None
    return ServerState(config, engine, engine_loop, tracer, metrics, int(time.time()), options, RequestIds(stored))


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """``GET /health`` and ``GET /metrics``: open, no key."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness, with the scheduler's load."""
        return {"status": "ok", "model": state.config.model, "running": state.loop.running,
                "waiting": state.loop.waiting}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``, behind the API key."""
    config = state.config

    def generation_key(credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        check_key(config.api_key, credentials)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, dependencies=[Depends(generation_key)])
    async def models() -> ModelList:
        """The one model this server serves."""
        return ModelList(data=[ModelCard(id=config.model, created=state.created)])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERROR_RESPONSES,
              dependencies=[Depends(generation_key)])
    async def chat_completions(
        request: Request,
        body: ChatCompletionRequest,
        x_request_id: str | None = Header(None, description="Request id (sampling and trace lookup)."),
        x_sparseety_trace: str | None = Header(None, description="1 forces a tier-3 trace of this request."),
    ) -> Response:
        """Chat completion (greedy); ``sparsity`` overrides the policy; streaming with ``stream``."""
        return await _generate(state, request, body, x_request_id, x_sparseety_trace)

    @app.post("/v1/completions", response_model=Completion, responses=ERROR_RESPONSES,
              dependencies=[Depends(generation_key)])
    async def completions(
        request: Request,
        body: CompletionRequest,
        x_request_id: str | None = Header(None, description="Request id (sampling and trace lookup)."),
        x_sparseety_trace: str | None = Header(None, description="1 forces a tier-3 trace of this request."),
    ) -> Response:
        """Text completion of a raw prompt (greedy)."""
        return await _generate(state, request, body, x_request_id, x_sparseety_trace)


def _add_trace_routes(app: FastAPI, state: ServerState) -> None:
    """``GET /v1/traces`` and ``GET /v1/traces/{request_id}``: only with a key and a trace store."""
    config, tracer = state.config, state.tracer

    def trace_key(credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        check_trace_access(config.api_key, tracer.enabled, credentials)

    @app.get("/v1/traces", response_model=TraceList, responses=ERROR_RESPONSES, dependencies=[Depends(trace_key)])
    async def traces(limit: int = Query(20, ge=1, le=1000, description="Newest requests to list.")) -> JSONResponse:
        """Summaries of stored requests, newest first."""
        from sparseety.store import list_traces
        from sparseety.store.notices import collecting, warning_headers

        try:
            rows, notes = await anyio.to_thread.run_sync(
                lambda: collecting(lambda: list_traces(config.trace_dir, limit=limit, limits=config.sql_limits)))
        except QueryLimitError as exc:  # the store's SQL passed --sql-timeout or --sql-memory-limit
            raise APIError(503, str(exc), code="trace_read_limit") from None
        return JSONResponse({"object": "list", "data": _jsonable(rows)}, headers=warning_headers(notes))

    @app.get("/v1/traces/{request_id}", responses=ERROR_RESPONSES, dependencies=[Depends(trace_key)])
    async def trace(request_id: str) -> JSONResponse:
        """One stored request: its document and the names, dtypes and shapes of its arrays."""
        return await _stored_trace(state, request_id)


async def _stored_trace(state: ServerState, request_id: str) -> JSONResponse:
    """``GET /v1/traces/{request_id}``: the stored request, or why it is not there (202, 410, 404, 503)."""
    from sparseety.store import load_trace

    check_request_id(request_id)
    from sparseety.store.notices import collecting, warning_headers

    config = state.config
    try:
        stored, notes = await anyio.to_thread.run_sync(
            lambda: collecting(lambda: load_trace(config.trace_dir, request_id, limits=config.sql_limits)))
    except QueryLimitError as exc:
        raise APIError(503, str(exc), param="request_id", code="trace_read_limit") from None
    except RecordError as exc:
        return _trace_not_stored(state, request_id, exc)
    arrays = {name: {"dtype": str(a.dtype), "shape": list(a.shape)} for name, a in stored.arrays.items()}
    return JSONResponse(_jsonable({"request_id": stored.request_id, "tier": stored.tier,
                                   "document": stored.document, "arrays": arrays}),
                        headers=warning_headers(notes))


def _trace_not_stored(state: ServerState, request_id: str, exc: RecordError) -> JSONResponse:
    """202 while the request is still generating or being written, 410 when its trace was dropped; raises the
    404 otherwise."""
    tracer = state.tracer
    status = tracer.writer.status(request_id) if tracer.enabled else None
    if status == "pending" or state.loop.has(request_id):  # accepted, still generating or not committed
        return JSONResponse({"request_id": request_id, "status": "pending"}, status_code=202,
                            headers={"Retry-After": "1"})
    if status == "dropped":
        why = tracer.writer.drop_reason(request_id) or "the trace writer's queue was full or a write failed"
        return JSONResponse({"request_id": request_id, "status": "dropped", "reason": why, "error": {
            "message": f"this request's trace was dropped: {why} (counted in sparseety:trace_records_dropped)",
            "type": "invalid_request_error",
            "param": "request_id", "code": "trace_dropped"}}, status_code=410)
    raise APIError(404, str(exc), param="request_id", code="trace_not_found") from None


async def _generate(state: ServerState, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    request_id: str | None, trace_header: str | None) -> Response:
    arrival = time.perf_counter()
    request_id = check_request_id(request_id) if request_id is not None else uuid.uuid4().hex
    if state.stopping:
        raise _shutting_down(running=False)
    state.ids.claim(request_id)
    try:
        force = trace_header is not None and trace_header.strip().lower() in TRUE_HEADER
        plan = await anyio.to_thread.run_sync(functools.partial(
            plan_request, body, state.engine, state.config, state.tracer, request_id=request_id, force_trace=force,
            arrival=arrival))
        config = state.config
        options = request_options(state.options, plan)
        sink = RequestSink(state.engine.tokenizer, asyncio.get_running_loop(), stream=bool(body.stream))
        try:
            state.loop.submit(plan, sink, options)
        except QueueFull:
            if state.stopping:
                raise _shutting_down(running=False) from None
            state.metrics.request_rejected.labels("queue_full").inc()
            raise APIError(429, "the server is at capacity (the batch and its queue are full): retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
    except BaseException:
        state.ids.release(request_id, finished=False)
        raise
    headers = {"X-Request-Id": request_id}
    if not body.stream:
        try:
            outcome = await _outcome(request, sink, state.loop)
        except asyncio.CancelledError:  # the server cancelled the handler: the request leaves at the next step
            sink.cancel()
            state.loop.wake()
            raise
        except SparseetyError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        except Exception:
            if state.stopping:
                raise _shutting_down(running=True) from None
            raise
        finally:
            state.ids.release(request_id, finished=_finished(sink))
        if outcome is None:
            return Response(status_code=CLIENT_LEFT)
        return JSONResponse(response_body(plan, outcome, config.model, int(time.time())), headers=headers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _events(plan, sink, config.model, include_usage, state)
    return StreamingResponse(_cancel_when_left(events, sink, state, request_id), media_type="text/event-stream",
                             headers=headers)


async def _outcome(request: Request, sink: RequestSink, loop: EngineLoop) -> Outcome | None:
    """The finished generation, or None when the client disconnected first: the request then leaves the
    batch at the next step and frees its KV reservation."""
    while not sink.done.done():
        await asyncio.wait({sink.done}, timeout=DISCONNECT_POLL_S)
        if not sink.done.done() and await request.is_disconnected():
            sink.cancel()
            loop.wake()
            return None
    result, reason = sink.done.result()
    return Outcome(result, reason)


def _finished(sink: RequestSink) -> bool:
    """Whether the request ran to its end (its trace row, if any, was handed to the store)."""
    return sink.done.done() and not sink.done.cancelled() and sink.done.exception() is None


async def _cancel_when_left(events: AsyncIterator[str], sink: RequestSink, state: ServerState,
                            request_id: str) -> AsyncIterator[str]:
    """Pass the events on; when the client disconnects before the end, take the request out of the batch."""
    finished = False
    try:
        async for event in events:
            yield event
        finished = True
    finally:
        if not finished:
            sink.cancel()
            state.loop.wake()
        state.ids.release(request_id, finished=_finished(sink))


async def _events(plan: Plan, sink: RequestSink, model: str, include_usage: bool,
                  state: ServerState) -> AsyncIterator[str]:
    """Server-sent events: a role chunk (chat), text deltas as tokens arrive, the finish chunk, usage, [DONE]."""
    created = int(time.time())
    assert sink.pieces is not None
    if plan.operation == "chat":
        yield _sse(stream_chunk(plan, model, created, role=True, include_usage=include_usage))
    while (piece := await sink.pieces.get()) is not None:
        yield _sse(stream_chunk(plan, model, created, text=piece, include_usage=include_usage))
    try:
        result, reason = await sink.done
    except SparseetyError as exc:
        yield _sse(error_body(400, str(exc), None, "invalid_value"))
        yield "data: [DONE]\n\n"
        return
    except Exception as exc:  # shutdown, or a server bug: tell the client in-band (the status line is sent)
        if state.stopping:
            stopped = _shutting_down(running=True)
            yield _sse(error_body(stopped.status, stopped.message, None, stopped.code))
        else:
            yield _sse(error_body(500, f"internal error: {type(exc).__name__}", None, "internal_error"))
        yield "data: [DONE]\n\n"
        return
    yield _sse(stream_chunk(plan, model, created, finish=reason, include_usage=include_usage))
    if include_usage:
        yield _sse(usage_chunk(plan, result, model, created))
    yield "data: [DONE]\n\n"
