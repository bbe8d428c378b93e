"""The serving loop: one thread owns the model and runs continuous-batching steps; HTTP handlers only enqueue and await.

A handler :meth:`EngineLoop.submit` s a :class:`~sparseety.serve.planning.Plan` with a
:class:`RequestSink` and awaits the sink. The loop thread moves new requests into the
:class:`~sparseety.engine.batch.BatchEngine` at the next step boundary, runs a step (one forward for
every running sequence), hands each new token to its sink as the step ends (SSE streams send it at
once) and finishes requests whose sequence ended. A cancelled sink (the client left) leaves the batch
at the next step. Nothing here blocks the event loop: sinks are fed with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparseety.engine import RunResult, SparseEngine
from sparseety.engine.batch import BatchEngine, RequestFailure, StepOutput
from sparseety.engine.request import GenerationOptions
from sparseety.serve.planning import Plan


_LOG = logging.getLogger(__name__)


class QueueFull(Exception):
    """The batch is full and so is the waiting queue."""


@dataclass
class TokenTimes:
    """Arrival times (``time.perf_counter``) of generated tokens, one per token."""

    stamps: list[float] = field(default_factory=list)

    @property
    def first(self) -> float | None:
        return self.stamps[0] if self.stamps else None

    def gaps(self) -> list[float]:
        """Seconds between consecutive tokens."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class RequestSink:
    """Where the loop thread delivers one request's tokens and outcome.

    With ``stream`` it decodes the output so far after each token and puts each new piece of text on
    an ``asyncio.Queue`` (``None`` marks the end); text ending inside a multi-byte character is held
    back until the character is complete. :attr:`done` resolves to ``(result, finish_reason)`` or an
    exception.
    """

    def __init__(self, tokenizer: Any, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.tokenizer = tokenizer
        self.loop = loop
        self.pieces: asyncio.Queue[str | None] | None = asyncio.Queue() if stream else None
        self.done: asyncio.Future[tuple[RunResult, str]] = loop.create_future()
        self.times = TokenTimes()
        self.admitted: float | None = None  #: when the request entered the batch
        self.cancelled = threading.Event()
        self._ids: list[int] = []
        self._sent = 0

    def cancel(self) -> None:
        """Ask the loop to drop this request at the next step (thread-safe)."""
        self.cancelled.set()

    # -- called on the loop thread -------------------------------------------------------------------
    def token(self, token_id: int, now: float) -> None:
        self.times.stamps.append(now)
        if self.pieces is None:
            return
        self._ids.append(token_id)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._push(text[self._sent:])
            self._sent = len(text)

    def finish(self, result: RunResult, reason: str) -> None:
        if self.pieces is not None:
            text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
            self._push(text[self._sent:])
            self._push(None)
        self._resolve(lambda: self.done.done() or self.done.set_result((result, reason)))

    def fail(self, exc: BaseException) -> None:
        if self.pieces is not None:
            self._push(None)
        self._resolve(lambda: self.done.done() or self.done.set_exception(exc))

    def abandon(self) -> None:
        """The request left the batch because its client went away: end the stream, cancel the outcome."""
        if self.pieces is not None:
            self._push(None)
        self._resolve(self.done.cancel)

    def _push(self, item: str | None) -> None:
        if item == "":
            return
        assert self.pieces is not None
        self._resolve(lambda: self.pieces.put_nowait(item))  # type: ignore[union-attr]

    def _resolve(self, fn: Callable[[], object]) -> None:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the event loop has closed (server shutting down): nobody is listening
            pass


Finisher = Callable[[Plan, RunResult, str, RequestSink, float], None]


class EngineLoop:
    """Owns the model on one thread and batches every admitted request.

    Parameters
    ----------
    engine : the wrapped model (used from the loop thread only).
    max_batch : sequences decoded together (``--max-concurrency``).
    max_queue : requests waiting for a place in the batch before new ones get 429.
    prefill_chunk : prompt tokens prefilled per step.
    kv_memory_limit : bytes of KV the batch may reserve (None: unlimited).
    on_finish : called on the loop thread with ``(plan, result, finish_reason, sink, finished)`` before
        the sink resolves (metrics, tracing).
    on_step : called on the loop thread after every step with the batch engine.
    on_abort : called with the request id of a request whose client left.
    on_fail : called with ``(plan, failure)`` when one request failed alone (its sink then fails with its error).
    """

    def __init__(self, engine: SparseEngine, *, max_batch: int, max_queue: int, prefill_chunk: int,
                 kv_memory_limit: int | None, on_finish: Finisher, on_step: Callable[[BatchEngine], None],
                 on_abort: Callable[[str], None],
                 on_fail: Callable[[Plan, RequestFailure], None] = lambda *_: None) -> None:
        self.batch = BatchEngine(engine, max_batch=max_batch, prefill_chunk=prefill_chunk,
                                 kv_memory_limit=kv_memory_limit)
        self.max_batch, self.max_queue = max_batch, max_queue
        self._on_finish, self._on_step, self._on_abort, self._on_fail = on_finish, on_step, on_abort, on_fail
        self._inbox: deque[tuple[Plan, RequestSink, GenerationOptions]] = deque()
        self._live: dict[str, tuple[Plan, RequestSink]] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sparseety-engine-loop", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        """Requests in the batch now."""
        return self.batch.running

    @property
    def waiting(self) -> int:
        """Requests accepted but not yet in the batch."""
        return len(self._inbox) + self.batch.waiting

    def has(self, request_id: str) -> bool:
        """True while ``request_id`` is queued or generating."""
        with self._wake:  # the loop thread drains the inbox under this lock
            queued = any(plan.request_id == request_id for plan, _, _ in self._inbox)
        return queued or request_id in self._live

    def submit(self, plan: Plan, sink: RequestSink, options: GenerationOptions) -> None:
        """Queue a request for the next step; raises :class:`QueueFull` when the queue has no room."""
        with self._wake:
            if self._stopping:
                raise QueueFull
            if self.waiting >= self.max_queue + max(0, self.max_batch - self.running):
                raise QueueFull
            self._inbox.append((plan, sink, options))
            self._wake.notify()

    def wake(self) -> None:
        """Let the loop notice a cancellation while it is idle."""
        with self._wake:
            self._wake.notify()

    def shutdown(self) -> None:
        """Stop after the current step; unfinished requests fail."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    # -- the loop thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._inbox and not self.batch.has_work():
                    self._wake.wait()
                if self._stopping:
                    break
                arrivals = list(self._inbox)
                self._inbox.clear()
            for plan, sink, options in arrivals:
                self._add(plan, sink, options)
            self._drop_cancelled()
            if not self.batch.has_work():
                continue
            try:
                outputs = self.batch.step()
            except Exception as exc:  # a bug outside any one request's part of the step: fail them all, keep serving
                _LOG.exception("sparseety engine loop: a step failed outside any one request")
                self._fail_all(exc)
                continue
            now = time.perf_counter()
            for request in self.batch.scheduler.running:
                live = self._live.get(request.request_id)
                if live is not None and live[1].admitted is None:
                    live[1].admitted = now
            for out in outputs:
                self._deliver(out, now)
            _guarded(self._on_step, self.batch)
        self._fail_all(RuntimeError("the server is shutting down"))

    def _add(self, plan: Plan, sink: RequestSink, options: GenerationOptions) -> None:
        try:
            self.batch.add(plan.encoded, plan.policy, options, request_id=plan.request_id)
        except Exception as exc:
            sink.fail(exc)
            return
        self._live[plan.request_id] = (plan, sink)

    def _drop_cancelled(self) -> None:
        for request_id, (_, sink) in list(self._live.items()):
            if sink.cancelled.is_set():
                self.batch.abort(request_id)
                del self._live[request_id]
                self._on_abort(request_id)
                sink.abandon()

    def _deliver(self, out: StepOutput, now: float) -> None:
        live = self._live.get(out.request.request_id)
        if live is None:
            return
        plan, sink = live
        if out.failure is not None:  # this request alone failed (admission, its part of a step, its result)
            del self._live[out.request.request_id]
            self.batch.failures.pop(out.request.request_id, None)
            _LOG.warning("sparseety engine loop: %s", out.failure.message())
            _guarded(self._on_fail, plan, out.failure)
            sink.fail(out.failure.error)
            return
        if out.token_id is None:
            return
        sink.token(out.token_id, now)
        if not out.finished:
            return
        del self._live[out.request.request_id]
        assert out.result is not None and out.finish_reason is not None
        _guarded(self._on_finish, plan, out.result, out.finish_reason, sink, now)
        sink.finish(out.result, out.finish_reason)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, (_, sink) in list(self._live.items()):
            self.batch.abort(request_id)
            sink.fail(exc)
        self._live.clear()
        with self._wake:
            arrivals = list(self._inbox)
            self._inbox.clear()
        for _, sink, _ in arrivals:
            sink.fail(exc)


def _guarded(fn: Callable[..., None], *args: Any) -> None:
    """Run a bookkeeping callback (metrics, tracing); its failure is logged and never stops the loop."""
    try:
        fn(*args)
    except Exception:
        _LOG.exception("sparseety engine loop: %s failed", getattr(fn, "__name__", fn))
