"""The API server's hooks on vLLM's ``OutputProcessor``: preemptions, finished requests and aborted ones, handed to
the process's :class:`.observer.Observer` (each body guarded: an observer error is logged, never raised)."""

from __future__ import annotations

from typing import Any

from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.vllm_api.guards import guarded

HOOKS = ("preemptions", "finished-requests", "aborted-requests")


def install(on: dict[str, bool]) -> None:
    """Patch ``OutputProcessor`` for each of :data:`HOOKS` that ``on`` (the adapter's check) leaves on."""
    output_processor = adapter.resolve(adapter.OP)
    if on["preemptions"]:
        _patch_preemptions(output_processor)
    if on["finished-requests"]:
        _patch_finished(output_processor)
        if on["aborted-requests"]:
            _patch_aborted(output_processor)


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
    recorded with what it produced, ``finish_reason`` ``abort`` (vLLM reports no stats for it). A parent of
    ``n > 1`` choices is aborted by its internal id, which names no state: vLLM then aborts its children through
    a call of its own, which this wrapper sees too, so each choice is recorded once."""
    def make(original):
        def abort_requests(self, request_ids, *args, **kwargs):
            request_ids = list(request_ids)  # an iterable, read twice: here and by vLLM
            states = guarded("aborted-requests", adapter.aborting, self, request_ids) or []
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
    from sparseety.integrations.vllm.observe.observer import observer

    return observer()


