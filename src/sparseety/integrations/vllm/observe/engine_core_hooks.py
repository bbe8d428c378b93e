"""The engine core's hooks on vLLM's scheduler: prefill chunks, drafts, the KV blocks a request held and its window
frees, and the owners of other API servers' requests, sent on the scheduler channel (:func:`send`) to the API
server that owns each request, as the typed messages of :mod:`..vllm_api.wire_messages`."""

from __future__ import annotations

from typing import Any

from sparseety.integrations.vllm.observe.window_frees import WindowFrees
from sparseety.integrations.vllm.transport.channels import client_channel
from sparseety.integrations.vllm.transport.wire import WireSender
from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.vllm_api.guards import guarded
from sparseety.integrations.vllm.vllm_api.wire_messages import Message

HOOKS = ("prefill-chunks", "drafts", "kv-blocks", "window-frees")
_ROUTE = True  #: route engine-core records to the owning API server (``Request.client_index``)


def install(on: dict[str, bool]) -> None:
    """Patch the scheduler (and the KV-cache coordinator) for each of :data:`HOOKS` that ``on`` leaves on;
    ``on["ranks"]``: route each record to the API server that owns its request."""
    global _ROUTE
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


_SENDER: WireSender | None = None
SEND_HWM = 10_000  #: frames queued per API server before the scheduler's sends drop (counted)


def send(messages: list[Message], requests: Any = None, client: int | None = None) -> None:
    """Send ``messages`` on the scheduler channel, opened on first use (non-blocking: a full queue drops).

    ``requests`` (the scheduler's ``request id -> Request``): each message goes to the API server that owns its
    request (``Request.client_index``; 0 for a request not there); ``client`` names it for all of them."""
    global _SENDER
    if _SENDER is None:
        _SENDER = WireSender(client_channel, hwm=SEND_HWM)
    if client is not None:
        _SENDER.send(messages, client)
        return
    by_client: dict[int, list[Message]] = {}
    requests = requests or {}
    for message in messages:
        by_client.setdefault(_client_of(requests.get(message.req_id)), []).append(message)
    for owner, part in by_client.items():
        _SENDER.send(part, owner)


def _client_of(request: Any) -> int:
    """The API server (client index) that owns ``request`` (0 when the ``ranks`` check is off)."""
    return adapter.client_of(request, _ROUTE)


def _patch_schedule(cls: Any) -> None:
    """``prefill-chunks`` (and the owners of other API servers' requests, ``ranks``): the scheduler's
    per-step bookkeeping."""
    def chunks_of(scheduler: Any, args: tuple, kwargs: dict) -> list[Message]:
        return adapter.prefill_chunks(scheduler, adapter.arg(args, kwargs, 0, "scheduler_output"))

    def owners_of(scheduler: Any, args: tuple, kwargs: dict) -> list[Message]:
        if not _ROUTE:
            return []
        return adapter.owners_of(scheduler, adapter.arg(args, kwargs, 0, "scheduler_output"), _ROUTE)

    def make(original):
        def _update_after_schedule(self, *args, **kwargs):
            chunks = guarded("prefill-chunks", chunks_of, self, args, kwargs)
            owners = guarded("prefill-chunks", owners_of, self, args, kwargs)
            result = original(self, *args, **kwargs)
            if chunks:
                guarded("prefill-chunks", send, chunks, adapter.scheduler_requests(self))
            if owners:
                guarded("prefill-chunks", send, owners, None, 0)
            return result
        return _update_after_schedule

    adapter.patch(cls, "_update_after_schedule", "prefill-chunks", make)


def _patch_drafts(cls: Any) -> None:
    """``drafts``: the speculative drafts each verify step checked, with ids and positions."""
    def on_step(scheduler: Any, args: tuple, kwargs: dict) -> list[Message]:
        scheduler_output = adapter.arg(args, kwargs, 0, "scheduler_output")
        if not adapter.has_drafts(scheduler_output):  # no speculative decoding: one dict check
            return []
        return adapter.drafts_of(scheduler, scheduler_output, adapter.arg(args, kwargs, 1, "model_runner_output"))

    def make(original):
        def update_from_output(self, *args, **kwargs):
            drafts = guarded("drafts", on_step, self, args, kwargs)
            result = original(self, *args, **kwargs)
            if drafts:
                guarded("drafts", send, drafts, adapter.scheduler_requests(self))
            return result
        return update_from_output

    adapter.patch(cls, "update_from_output", "drafts", make)


def _patch_kv_blocks(cls: Any, window: bool) -> None:
    """``kv-blocks``: the KV bytes a request held, read when vLLM frees its blocks; with ``window``
    (``window-frees`` on) also its peak and the blocks its sliding-window groups freed on the way."""
    def window_record(scheduler: Any, request: Any) -> Message | None:
        return _WINDOW.finish(adapter.coordinator_of(scheduler), adapter.request_id(request))

    def make(original):
        def _free_request_blocks(self, *args, **kwargs):
            request = adapter.arg(args, kwargs, 0, "request")
            held = guarded("kv-blocks", adapter.blocks_of, self, request)
            frees = guarded("window-frees", window_record, self, request) if window else None
            result = original(self, *args, **kwargs)
            if held:
                guarded("kv-blocks", send, held, {held[0].req_id: request})
            if frees:
                guarded("window-frees", _send_window, frees, request)
            return result
        return _free_request_blocks

    adapter.patch(cls, "_free_request_blocks", "kv-blocks", make)


_WINDOW = WindowFrees()
_GROUPS_SENT: set[int] = set()  #: API servers told the KV-cache groups


def _send_window(record: Message, request: Any) -> None:
    """One request's peak and window frees, after the groups its API server has not had yet."""
    client = _client_of(request)
    if client not in _GROUPS_SENT:
        _GROUPS_SENT.add(client)
        send([_WINDOW.groups_message()], client=client)
    send([record], client=client)


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
