"""vLLM's ``vllm.general_plugins`` entry point: hooks the frontend's output loop and the scheduler (vLLM 0.32).

vLLM loads general plugins in every process it starts (API server, engine core, workers) and may call
them more than once; :func:`register` patches vLLM's ``OutputProcessor`` and ``Scheduler`` classes once
per process. Only the API-server process runs an ``OutputProcessor`` and only the engine core schedules,
so each hook fires where it belongs. Each hook calls vLLM's own method first and then hands on what it
needs; an observer error is logged, never raised (:func:`.hooks.guarded`). Every vLLM method it wraps and
every attribute it reads is declared in :mod:`.adapter` and checked there at load (:func:`.adapter.check`);
a hook whose need is missing is off, with one warning, and the others stay on. The wrappers read vLLM's
objects only through the adapter's readers.

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
  of other API servers' requests to them (:class:`.importance_consumer.ImportanceConsumer`).

The first process to register picks the channel (``$SPARSEETY_VLLM_CHANNEL``, an ``ipc://`` path) and
the processes it spawns inherit it. With ``--api-server-count N`` each API server (vLLM's client index
``k``, ``ParallelConfig._api_process_rank``) binds its own channel, :func:`.channels.client_channel` (``k = 0``: the
channel itself), and the engine core sends each record to the channel of the API server that owns the
request (``Request.client_index``, the index vLLM routes the request's outputs by), so every request's
records reach the one process that records it. With ``--data-parallel-size N`` every engine core's
scheduler sends on these channels (PUSH sockets from many processes into one PULL).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sparseety.errors import ConfigError
from sparseety.integrations.vllm import adapter, request_guard
from sparseety.integrations.vllm.evict import hooks as eviction_hooks
from sparseety.integrations.vllm.channels import CHANNEL_ENV, channel, client_channel
from sparseety.integrations.vllm.env_names import unknown_variables
from sparseety.integrations.vllm.evict.settings import EvictionSettings, parse_eviction
from sparseety.integrations.vllm.hooks import guarded
from sparseety.integrations.vllm.window_frees import WindowFrees

log = logging.getLogger("sparseety.vllm")
_ROUTE = True  #: route engine-core records to the owning API server (``Request.client_index``)
ENGINE_CORE_HOOKS = ("prefill-chunks", "drafts", "kv-blocks", "window-frees")
FRONTEND_HOOKS = ("preemptions", "finished-requests", "aborted-requests")


def register() -> None:
    """Install the hooks (idempotent, never raising). A hook whose vLLM internal is missing or changed
    is off, with one warning (in the first process that registers; the processes it starts stay quiet)."""
    global _ROUTE
    loud = CHANNEL_ENV not in os.environ
    eviction = _eviction_or_exit()
    try:
        if loud:
            for line in unknown_variables(os.environ):
                log.warning(line)
        channel()
        on = adapter.check(("ranks", *ENGINE_CORE_HOOKS, *FRONTEND_HOOKS), loud=loud)
        _ROUTE = on["ranks"]
        scheduler = adapter.resolve(adapter.SCHED)
        if on["prefill-chunks"]:
            _patch_schedule(scheduler)
        if on["drafts"]:
            _patch_drafts(scheduler)
        if on["kv-blocks"]:
            _patch_kv_blocks(scheduler, window=on["window-frees"])
            if on["window-frees"]:
                _patch_window_frees(adapter.resolve(adapter.COORD))
        output_processor = adapter.resolve(adapter.OP)
        if on["preemptions"]:
            _patch_preemptions(output_processor)
        if on["finished-requests"]:
            _patch_finished(output_processor)
            if on["aborted-requests"]:
                _patch_aborted(output_processor)
        _patch_attention(loud)
        evicting = eviction_hooks.install(loud, eviction, send=_send)
        request_guard.install(loud, eviction if evicting else None)
    except Exception:
        log.exception("sparseety: installing the vLLM hooks failed; vLLM is unaffected")


def _eviction_or_exit() -> EvictionSettings | None:
    """The ``SPARSEETY_KV_*`` settings, or SystemExit with one line naming the bad one: in ``vllm serve``'s first
    process this runs while vLLM reads its arguments, before any model loads."""
    try:
        return parse_eviction()
    except ConfigError as exc:
        raise SystemExit(f"sparseety: {exc}; vLLM not started (unset SPARSEETY_KV_POLICY to serve without "
                         "SparSEEty's eviction)") from None


def _patch_attention(loud: bool) -> None:
    """``importance-rows``, ``importance-finish`` and ``importance-attention``: the worker's model runner
    and the attention backend it chose, for the important tokens of sampled requests (:mod:`.worker_hooks`)."""
    from sparseety.integrations.vllm.worker_hooks import install

    install(loud)
    from sparseety.integrations.vllm import routing_capture

    routing_capture.install(loud)  # ``moe-routing``: the MoE routing of every request (:mod:`.routing_capture`)


# -- API server: the frontend's per-output loop ------------------------------------------------------------
def _patch_preemptions(cls: Any) -> None:
    preempted = adapter.preempted_type()

    def on_events(events: Any, args: tuple, kwargs: dict) -> None:
        for event in events:
            if adapter.is_preemption(event, preempted):
                _observer().on_preempted(adapter.arg(args, kwargs, 0, "req_state"))

    def make(original):
        def _update_stats_from_output(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            events = adapter.output_events(adapter.arg(args, kwargs, 1, "engine_core_output"))
            if events:  # per output and step: nothing more unless it has events
                guarded("preemptions", on_events, events, args, kwargs)
            return result
        return _update_stats_from_output

    adapter.patch(cls, "_update_stats_from_output", "preemptions", make)


def _patch_finished(cls: Any) -> None:
    def on_finished(args: tuple, kwargs: dict) -> None:
        _observer().on_finished(adapter.arg(args, kwargs, 0, "req_state"),
                                adapter.arg(args, kwargs, 1, "finish_reason"))

    def make(original):
        def _update_stats_from_finished(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            guarded("finished-requests", on_finished, args, kwargs)
            return result
        return _update_stats_from_finished

    adapter.patch(cls, "_update_stats_from_finished", "finished-requests", make)


def _patch_aborted(cls: Any) -> None:
    """``aborted-requests``: a request vLLM drops before it finishes (its client went away, or it was aborted) is
    recorded with what it produced, ``finish_reason`` ``abort`` (vLLM reports no stats for it)."""
    def make(original):
        def abort_requests(self, request_ids, *args, **kwargs):
            states = guarded("aborted-requests", adapter.aborting, self, list(request_ids)) or []
            result = original(self, request_ids, *args, **kwargs)
            if states:
                guarded("aborted-requests", _on_aborted, states)
            return result
        return abort_requests

    adapter.patch(cls, "abort_requests", "aborted-requests", make)


def _on_aborted(states: list[Any]) -> None:
    observer = _observer()
    for state in states:
        observer.on_aborted(state)


def _observer():
    from sparseety.integrations.vllm.observer import observer

    return observer()


# -- engine core: the scheduler ----------------------------------------------------------------------------
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
    """The API server (client index) that owns ``request`` (0 when the ``ranks`` check is off)."""
    return adapter.client_of(request, _ROUTE)


def _patch_schedule(cls: Any) -> None:
    """``prefill-chunks`` (and the owners of other API servers' requests, ``ranks``): the scheduler's
    per-step bookkeeping."""
    def chunks_of(scheduler: Any, args: tuple, kwargs: dict) -> list[list]:
        return adapter.prefill_chunks(scheduler, adapter.arg(args, kwargs, 0, "scheduler_output"))

    def owners_of(scheduler: Any, args: tuple, kwargs: dict) -> list[list]:
        if not _ROUTE:
            return []
        return adapter.owners_of(scheduler, adapter.arg(args, kwargs, 0, "scheduler_output"), _ROUTE)

    def make(original):
        def _update_after_schedule(self, *args, **kwargs):
            chunks = guarded("prefill-chunks", chunks_of, self, args, kwargs)
            owners = guarded("prefill-chunks", owners_of, self, args, kwargs)
            result = original(self, *args, **kwargs)
            if chunks:
                guarded("prefill-chunks", _send, "chunk", chunks, adapter.scheduler_requests(self))
            if owners:
                guarded("prefill-chunks", _send, "owner", owners)
            return result
        return _update_after_schedule

    adapter.patch(cls, "_update_after_schedule", "prefill-chunks", make)


def _patch_drafts(cls: Any) -> None:
    """``drafts``: the speculative drafts each verify step checked, with ids and positions."""
    def on_step(scheduler: Any, args: tuple, kwargs: dict) -> list[list]:
        scheduler_output = adapter.arg(args, kwargs, 0, "scheduler_output")
        if not adapter.has_drafts(scheduler_output):  # no speculative decoding: one dict check
            return []
        return adapter.drafts_of(scheduler, scheduler_output, adapter.arg(args, kwargs, 1, "model_runner_output"))

    def make(original):
        def update_from_output(self, *args, **kwargs):
            drafts = guarded("drafts", on_step, self, args, kwargs)
            result = original(self, *args, **kwargs)
            if drafts:
                guarded("drafts", _send, "draft", drafts, adapter.scheduler_requests(self))
            return result
        return update_from_output

    adapter.patch(cls, "update_from_output", "drafts", make)


def _patch_kv_blocks(cls: Any, window: bool) -> None:
    """``kv-blocks``: the KV bytes a request held, read when vLLM frees its blocks; with ``window``
    (``window-frees`` on) also its peak and the blocks its sliding-window groups freed on the way."""
    def window_record(scheduler: Any, request: Any) -> list | None:
        return _WINDOW.finish(adapter.coordinator_of(scheduler), adapter.request_id(request))

    def make(original):
        def _free_request_blocks(self, *args, **kwargs):
            request = adapter.arg(args, kwargs, 0, "request")
            held = guarded("kv-blocks", adapter.blocks_of, self, request)
            frees = guarded("window-frees", window_record, self, request) if window else None
            result = original(self, *args, **kwargs)
            if held:
                guarded("kv-blocks", _send, "kv", held, {held[0][0]: request})
            if frees:
                guarded("window-frees", _send_window, frees, request)
            return result
        return _free_request_blocks

    adapter.patch(cls, "_free_request_blocks", "kv-blocks", make)


_WINDOW = WindowFrees()
_GROUPS_SENT: set[int] = set()  #: API servers told the KV-cache groups


def _send_window(record: list, request: Any) -> None:
    """``window``: one request's peak and window frees, after the groups its API server has not had yet."""
    client = _client_of(request)
    if client not in _GROUPS_SENT:
        _GROUPS_SENT.add(client)
        _send("groups", [[-1, _WINDOW.groups_record()]], {-1: request})
    _send("window", [record], {record[0]: request})


def _patch_window_frees(cls: Any) -> None:
    """``window-frees``: around the coordinator's ``remove_skipped_blocks`` (every scheduled request, every
    step), the blocks the request holds (a peak candidate) and those its sliding-window groups free."""
    def make(original):
        def remove_skipped_blocks(self, *args, **kwargs):
            request_id = adapter.arg(args, kwargs, 0, "request_id")
            nulls = guarded("window-frees", _WINDOW.before, self, request_id)
            result = original(self, *args, **kwargs)
            if nulls is not None:
                guarded("window-frees", _WINDOW.after, self, request_id,
                        adapter.arg(args, kwargs, 1, "processed_computed_tokens"), nulls)
            return result
        return remove_skipped_blocks

    adapter.patch(cls, "remove_skipped_blocks", "window-frees", make)
