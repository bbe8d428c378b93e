"""vLLM's ``vllm.general_plugins`` entry point: hooks the frontend's output loop and the scheduler (vLLM 0.32).

vLLM loads general plugins in every process it starts (API server, engine core, workers) and may call
them more than once; :func:`register` patches vLLM's ``OutputProcessor`` and ``Scheduler`` classes once
per process. Only the API-server process runs an ``OutputProcessor`` and only the engine core schedules,
so each hook fires where it belongs. Each hook calls vLLM's own method first and then hands on what it
needs; an observer error is logged, never raised.

The scheduler hook sees what the frontend never does: each prefill chunk (a prompt prefilled over
several steps, ``--max-num-batched-tokens``). It sends ``[request id, first position, tokens]`` per chunk
over a ZMQ PUSH socket (non-blocking, bounded; what does not fit is dropped and counted) to the
observer's PULL socket in the API server. The first process to register picks the channel
(``$SPARSEETY_VLLM_CHANNEL``, an ``ipc://`` path) and the processes it spawns inherit it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid

log = logging.getLogger("sparseety.vllm")
_PATCHED = "_sparseety_patched"
CHANNEL_ENV = "SPARSEETY_VLLM_CHANNEL"


def channel() -> str:
    """The scheduler-to-observer channel, chosen by the first process that registers."""
    if CHANNEL_ENV not in os.environ:
        name = f"sparseety-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
        os.environ[CHANNEL_ENV] = "ipc://" + os.path.join(tempfile.gettempdir(), name)
    return os.environ[CHANNEL_ENV]


def register() -> None:
    """Install the hooks (idempotent)."""
    channel()
    _patch_scheduler()
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


class _ChunkSender:
    """The engine core's end of the channel: PUSH, never blocking (a full queue drops and counts)."""

    def __init__(self) -> None:
        import msgspec
        import zmq

        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 10_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(channel())
        self._encode = msgspec.msgpack.Encoder().encode
        self.dropped = 0

    def send(self, chunks: list[list]) -> None:
        try:
            self._socket.send(self._encode(chunks), self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += len(chunks)


_SENDER: _ChunkSender | None = None


def _patch_scheduler() -> None:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return
    if getattr(Scheduler, _PATCHED, False):
        return
    update_after_schedule = Scheduler._update_after_schedule

    def _update_after_schedule(self, scheduler_output):
        chunks = []
        try:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                request = self.requests[req_id]
                start = request.num_computed_tokens  # before vLLM advances it below
                if start < request.num_prompt_tokens:
                    chunks.append([req_id, start, min(n, request.num_prompt_tokens - start)])
        except Exception:
            log.exception("sparseety: prefill-chunk hook failed")
            chunks = []
        update_after_schedule(self, scheduler_output)
        if chunks:
            global _SENDER
            try:
                if _SENDER is None:
                    _SENDER = _ChunkSender()
                _SENDER.send(chunks)
            except Exception:
                log.exception("sparseety: sending prefill chunks failed")

    Scheduler._update_after_schedule = _update_after_schedule
    setattr(Scheduler, _PATCHED, True)
