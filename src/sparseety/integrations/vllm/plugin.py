"""vLLM's ``vllm.general_plugins`` entry point: hooks the frontend's output loop and the scheduler (vLLM 0.32).

vLLM loads general plugins in every process it starts (API server, engine core, workers) and may call
them more than once; :func:`register` patches vLLM's ``OutputProcessor`` and ``Scheduler`` classes once
per process. Only the API-server process runs an ``OutputProcessor`` and only the engine core schedules,
so each hook fires where it belongs. Each hook calls vLLM's own method first and then hands on what it
needs; an observer error is logged, never raised (:func:`.hooks.guarded`). Each hook first checks that
the method it wraps exists with the parameters it was written for (:func:`.hooks.expect`); if not, that
hook alone is off, with one warning.

The scheduler hooks see what the frontend never does, and send it over a ZMQ PUSH socket
(non-blocking, bounded; what does not fit is dropped and counted) to the observer's PULL socket in the
API server, one ``[kind, records]`` message per step and kind:

- ``prefill-chunks`` (``chunk``): ``[request id, first position, tokens]`` per prefill chunk (a prompt
  prefilled over several steps, ``--max-num-batched-tokens``);
- ``drafts`` (``draft``): ``[request id, step, first position, draft ids, accepted]`` per request and
  verify step of speculative decoding: the drafts vLLM verified, where they stand in the sequence, and how
  many of them (a prefix) the target model accepted;
- ``kv-blocks`` (``kv``): ``[request id, bytes, blocks]`` when vLLM frees a request's KV blocks (it
  finished, or was preempted): the KV-cache bytes of the blocks it held;
- ``owners`` (``owner``, to API server 0 only, only with ``--api-server-count > 1``): ``[request id,
  client index]`` for each new request another API server owns. The worker's importance results go to API
  server 0's importance channel (the worker cannot see a request's client); API server 0 forwards those
  of other API servers' requests to them (:meth:`.observer.Observer.forward_importance`).

The first process to register picks the channel (``$SPARSEETY_VLLM_CHANNEL``, an ``ipc://`` path) and
the processes it spawns inherit it. With ``--api-server-count N`` each API server (vLLM's client index
``k``, ``ParallelConfig._api_process_rank``) binds its own channel, :func:`.channels.client_channel` (``k = 0``: the
channel itself), and the engine core sends each record to the channel of the API server that owns the
request (``Request.client_index``, the index vLLM routes the request's outputs by), so every request's
records reach the one process that records it. With ``--data-parallel-size N`` every engine core's
scheduler sends on these channels (PUSH sockets from many processes into one PULL).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from sparseety.integrations.vllm.channels import CHANNEL_ENV, channel, client_channel
from sparseety.integrations.vllm.hooks import MARK, expect, guarded, hook_off

log = logging.getLogger("sparseety.vllm")


def register() -> None:
    """Install the hooks (idempotent, never raising). A hook whose vLLM internal is missing or changed
    is off, with one warning (in the first process that registers; the processes it starts stay quiet)."""
    try:
        loud = CHANNEL_ENV not in os.environ
        channel()
        _check_ranks(loud)
        _patch_scheduler(loud)
        _patch_drafts(loud)
        _patch_kv_blocks(loud)
        _patch_output_processor(loud)
        _patch_attention(loud)
    except Exception:
        log.exception("sparseety: installing the vLLM hooks failed; vLLM is unaffected")


_ROUTE = True  #: route engine-core records to the owning API server (``Request.client_index``)


def _check_ranks(loud: bool) -> None:
    """``ranks``: the engine core reads ``Request.client_index`` to route each record to the API server
    that owns the request. Without it every record goes to API server 0, as with one API server."""
    global _ROUTE
    try:
        from vllm.v1.request import Request
    except ImportError:
        hook_off("ranks", "vllm.v1.request.Request", loud=loud)
        _ROUTE = False
        return
    params = ("request_id", "prompt_token_ids", "sampling_params", "pooling_params", "client_index")
    _ROUTE = expect(Request, "__init__", params, "ranks", prefix=True, loud=loud) is not None


def _patch_attention(loud: bool) -> None:
    """``importance-rows``, ``importance-finish`` and ``importance-attention``: the worker's model runner
    and the attention backend it chose, for the important tokens of sampled requests (:mod:`.attention_capture`)."""
    from sparseety.integrations.vllm.attention_capture import install

    install(loud)


def _installed(owner: Any, attr: str) -> bool:
    return getattr(inspect.getattr_static(owner, attr, None), MARK, None) is not None


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    """Parameter ``name`` (the ``index``-th after ``self``) of a call vLLM made."""
    return args[index] if len(args) > index else kwargs[name]


def _install(owner: Any, attr: str, hook: str, original: Callable, wrapper: Callable) -> None:
    """Put ``wrapper`` (which passes vLLM's call through to ``original`` unchanged) in place."""
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARK, hook)
    setattr(owner, attr, wrapper)


def _patch_output_processor(loud: bool) -> None:
    """``preemptions`` and ``finished-requests``: the frontend's per-output loop (API-server process)."""
    try:
        from vllm.v1.engine.output_processor import OutputProcessor
    except ImportError:
        for hook in ("preemptions", "finished-requests"):
            hook_off(hook, "vllm.v1.engine.output_processor.OutputProcessor", loud=loud)
        return
    if not _installed(OutputProcessor, "_update_stats_from_output"):
        _patch_preemptions(OutputProcessor, loud)
    if not _installed(OutputProcessor, "_update_stats_from_finished"):
        _patch_finished(OutputProcessor, loud)


def _patch_preemptions(cls: Any, loud: bool) -> None:
    try:
        from vllm.v1.engine import EngineCoreEventType

        preempted = EngineCoreEventType.PREEMPTED
    except (ImportError, AttributeError):
        hook_off("preemptions", "vllm.v1.engine.EngineCoreEventType.PREEMPTED", loud=loud)
        return
    original = expect(cls, "_update_stats_from_output",
                      ("req_state", "engine_core_output", "engine_core_timestamp", "iteration_stats"),
                      "preemptions", loud=loud)
    if original is None:
        return

    def on_events(events: Any, args: tuple, kwargs: dict) -> None:
        for event in events:
            if event.type == preempted:
                _observer().on_preempted(_arg(args, kwargs, 0, "req_state"))

    def _update_stats_from_output(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        output = args[1] if len(args) > 1 else kwargs.get("engine_core_output")
        events = getattr(output, "events", None)  # per output and step: nothing more unless it has events
        if events:
            guarded("preemptions", on_events, events, args, kwargs)
        return result

    _install(cls, "_update_stats_from_output", "preemptions", original, _update_stats_from_output)


def _patch_finished(cls: Any, loud: bool) -> None:
    original = expect(cls, "_update_stats_from_finished", ("req_state", "finish_reason", "iteration_stats"),
                      "finished-requests", loud=loud)
    if original is None:
        return

    def on_finished(args: tuple, kwargs: dict) -> None:
        _observer().on_finished(_arg(args, kwargs, 0, "req_state"), _arg(args, kwargs, 1, "finish_reason"))

    def _update_stats_from_finished(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        guarded("finished-requests", on_finished, args, kwargs)
        return result

    _install(cls, "_update_stats_from_finished", "finished-requests", original, _update_stats_from_finished)


def _observer():
    from sparseety.integrations.vllm.observer import observer

    return observer()


class _ChunkSender:
    """The engine core's end of the channel: PUSH, never blocking (a full queue drops and counts)."""

    def __init__(self) -> None:
        import msgspec
        import zmq

        self._zmq = zmq
        self._sockets: dict[int, Any] = {}  #: API server (client index) -> PUSH to its channel
        self._encode = msgspec.msgpack.Encoder().encode
        self.dropped = 0

    def _socket(self, client: int) -> Any:
        sock = self._sockets.get(client)
        if sock is None:
            zmq = self._zmq
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(client_channel(client))
            self._sockets[client] = sock
        return sock

    def send(self, kind: str, records: list[list], client: int = 0) -> None:
        try:
            self._socket(client).send(self._encode([kind, records]), self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += len(records)


_SENDER: _ChunkSender | None = None
_SENDER_TRIED = False


def _patch_scheduler(loud: bool) -> None:
    """``prefill-chunks``: the scheduler's per-step bookkeeping (engine-core process)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        hook_off("prefill-chunks", "vllm.v1.core.sched.scheduler.Scheduler", loud=loud)
        return
    if _installed(Scheduler, "_update_after_schedule"):
        return
    original = expect(Scheduler, "_update_after_schedule", ("scheduler_output",), "prefill-chunks", loud=loud)
    if original is None:
        return

    def chunks_of(scheduler: Any, args: tuple, kwargs: dict) -> list[list]:
        chunks = []
        for req_id, n in _arg(args, kwargs, 0, "scheduler_output").num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            start = request.num_computed_tokens  # before vLLM advances it below
            if start < request.num_prompt_tokens:
                chunks.append([req_id, start, min(n, request.num_prompt_tokens - start)])
        return chunks

    def _update_after_schedule(self, *args, **kwargs):
        chunks = guarded("prefill-chunks", chunks_of, self, args, kwargs)
        owners = guarded("prefill-chunks", owners_of, self, args, kwargs)
        result = original(self, *args, **kwargs)
        if chunks:
            guarded("prefill-chunks", _send, "chunk", chunks, self.requests)
        if owners:
            guarded("prefill-chunks", _send, "owner", owners)
        return result

    _install(Scheduler, "_update_after_schedule", "prefill-chunks", original, _update_after_schedule)


def owners_of(scheduler: Any, args: tuple, kwargs: dict) -> list[list]:
    """``[request id, client index]`` for the newly scheduled requests that an API server other than 0
    owns (none with one API server: one attribute read per new request)."""
    owners = []
    for new in _arg(args, kwargs, 0, "scheduler_output").scheduled_new_reqs:
        client = _client_of(scheduler.requests.get(new.req_id))
        if client > 0:
            owners.append([new.req_id, client])
    return owners


def _send(kind: str, records: list[list], requests: Any = None) -> None:
    """Send on the channel, opened on first use (tried once: a channel that cannot open stays shut).

    ``requests`` (the scheduler's ``request id -> Request``): each record (``[request id, ...]``) goes to
    the API server that owns its request (``Request.client_index``; 0 for a request not there)."""
    global _SENDER, _SENDER_TRIED
    if _SENDER is None:
        if _SENDER_TRIED:
            return
        _SENDER_TRIED = True
        _SENDER = _ChunkSender()
    by_client: dict[int, list[list]] = {}
    requests = requests or {}
    for record in records:
        by_client.setdefault(_client_of(requests.get(record[0])), []).append(record)
    for client, part in by_client.items():
        _SENDER.send(kind, part, client)


def _client_of(request: Any) -> int:
    """The API server (client index) that owns ``request``: where vLLM sends its outputs (0 when the
    ``ranks`` check is off)."""
    return int(getattr(request, "client_index", 0) or 0) if _ROUTE else 0


def _scheduler_class(hook: str, loud: bool) -> Any:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        hook_off(hook, "vllm.v1.core.sched.scheduler.Scheduler", loud=loud)
        return None
    return Scheduler


def drafts_of(scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> list[list]:
    """``[request id, step, first position, draft ids, accepted]`` for each request that verified drafts in
    this step, read before vLLM's ``update_from_output`` appends the step's tokens.

    The drafts follow the request's last token: the first one stands at position ``request.num_tokens``
    (prompt plus output so far), ``step`` is the number of output tokens before this step (a decode
    step's index, as in SparSEEty's own engine). The target model accepted the first ``accepted`` drafts
    (its sampled ids minus the one token it samples itself), the rule vLLM's bookkeeping uses; requests
    vLLM skips there (finished, aborted, stale after a preemption, no sampled ids) are skipped here too.
    """
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return []
    sampled = model_runner_output.sampled_token_ids
    if not sampled:
        return []
    index = model_runner_output.req_id_to_index
    per_step = getattr(scheduler, "num_sampled_tokens_per_step", 1)
    records = []
    for req_id, draft_ids in spec.items():
        request = scheduler.requests.get(req_id)
        if not draft_ids or request is None or request.is_finished():
            continue
        if getattr(request, "num_stale_output_tokens", 0) > 0 and getattr(request, "drop_stale_output", False):
            continue
        row = index.get(req_id)
        if row is None or row >= len(sampled) or not len(sampled[row]):
            continue
        accepted = max(len(sampled[row]) - per_step, 0)
        records.append([req_id, int(request.num_output_tokens), int(request.num_tokens),
                        [int(t) for t in draft_ids], int(accepted)])
    return records


def _patch_drafts(loud: bool) -> None:
    """``drafts``: the speculative drafts each verify step checked, with ids and positions (engine core)."""
    Scheduler = _scheduler_class("drafts", loud)
    if Scheduler is None or _installed(Scheduler, "update_from_output"):
        return
    original = expect(Scheduler, "update_from_output", ("scheduler_output", "model_runner_output"), "drafts",
                      concrete=True, loud=loud)
    if original is None:
        return

    def on_step(scheduler: Any, args: tuple, kwargs: dict) -> list[list]:
        scheduler_output = _arg(args, kwargs, 0, "scheduler_output")
        if not scheduler_output.scheduled_spec_decode_tokens:  # no speculative decoding: one dict check
            return []
        return drafts_of(scheduler, scheduler_output, _arg(args, kwargs, 1, "model_runner_output"))

    def update_from_output(self, *args, **kwargs):
        drafts = guarded("drafts", on_step, self, args, kwargs)
        result = original(self, *args, **kwargs)
        if drafts:
            guarded("drafts", _send, "draft", drafts, self.requests)
        return result

    _install(Scheduler, "update_from_output", "drafts", original, update_from_output)


def blocks_of(scheduler: Any, request: Any) -> list[list]:
    """``[[request id, bytes, blocks]]``: the KV-cache blocks ``request`` holds now and their bytes (per KV
    cache group: its blocks times its page size times its layers), from vLLM's own block tables."""
    config = scheduler.kv_cache_config
    per_group = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    nbytes = blocks = 0
    for group, ids in zip(config.kv_cache_groups, per_group, strict=False):
        blocks += len(ids)
        nbytes += len(ids) * int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    return [[request.request_id, nbytes, blocks]] if blocks else []


def _patch_kv_blocks(loud: bool) -> None:
    """``kv-blocks``: the KV bytes a request held, read when vLLM frees its blocks (engine core)."""
    Scheduler = _scheduler_class("kv-blocks", loud)
    if Scheduler is None or _installed(Scheduler, "_free_request_blocks"):
        return
    original = expect(Scheduler, "_free_request_blocks", ("request",), "kv-blocks", concrete=True, loud=loud)
    if original is None:
        return

    def _free_request_blocks(self, *args, **kwargs):
        request = _arg(args, kwargs, 0, "request")
        held = guarded("kv-blocks", blocks_of, self, request)
        result = original(self, *args, **kwargs)
        if held:
            guarded("kv-blocks", _send, "kv", held, {request.request_id: request})
        return result

    _install(Scheduler, "_free_request_blocks", "kv-blocks", original, _free_request_blocks)
