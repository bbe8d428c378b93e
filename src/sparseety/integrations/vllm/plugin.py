"""vLLM's ``vllm.general_plugins`` entry point: hooks the frontend's output loop (vLLM 0.32).

vLLM loads general plugins in every process it starts (API server, engine core, workers) and may call
them more than once; :func:`register` patches vLLM's ``OutputProcessor`` class once per process. Only the
API-server process runs an ``OutputProcessor``, so the hooks fire there alone. Each hook calls vLLM's own
method first and then hands the observer what it needs; an observer error is logged, never raised.
"""

from __future__ import annotations

import logging

log = logging.getLogger("sparseety.vllm")
_PATCHED = "_sparseety_patched"


def register() -> None:
    """Install the hooks (idempotent)."""
    try:
        from vllm.v1.engine import EngineCoreEventType
        from vllm.v1.engine.output_processor import OutputProcessor
    except ImportError:  # a vLLM without the v1 frontend: metrics from the stat logger only
        log.warning("sparseety: vLLM's v1 OutputProcessor not found; per-request tracing is off")
        return
    if getattr(OutputProcessor, _PATCHED, False):
        return
    preempted = EngineCoreEventType.PREEMPTED
    update_from_output = OutputProcessor._update_stats_from_output
    update_from_finished = OutputProcessor._update_stats_from_finished

    def _update_stats_from_output(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats):
        update_from_output(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats)
        events = engine_core_output.events
        if events:
            try:
                for event in events:
                    if event.type == preempted:
                        _observer().on_preempted(req_state)
            except Exception:
                log.exception("sparseety: preemption hook failed")

    def _update_stats_from_finished(self, req_state, finish_reason, iteration_stats):
        update_from_finished(self, req_state, finish_reason, iteration_stats)
        try:
            _observer().on_finished(req_state, finish_reason)
        except Exception:
            log.exception("sparseety: finished-request hook failed")

    OutputProcessor._update_stats_from_output = _update_stats_from_output
    OutputProcessor._update_stats_from_finished = _update_stats_from_finished
    setattr(OutputProcessor, _PATCHED, True)


def _observer():
    from sparseety.integrations.vllm.observer import observer

    return observer()
