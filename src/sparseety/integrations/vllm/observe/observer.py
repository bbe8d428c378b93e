"""The observer inside vLLM's API-server process: joins the frontend, the stat logger, the engine core's
scheduler, KV events and the worker's importance by request id, and writes each request's record.

``docs/vllm.md`` draws the whole data flow. The pieces, each with one job (nothing here waits on vLLM's
loop, and vLLM's loop never waits on it):

1. :class:`Observer` (here): the frontend's hot path. :mod:`.frontend_hooks`' ``OutputProcessor`` hooks call
   :meth:`Observer.on_preempted`, :meth:`Observer.on_finished` and :meth:`Observer.on_aborted` (the request
   as a :class:`.messages.FinishedRequest`, read by :mod:`.adapter`). A finished request is held in a bounded
   map until :class:`~.stat_logger.SparseetyStatLogger` reports vLLM's ``FinishedRequestStats``
   (:meth:`Observer.on_finished_stats`: finish reason, cached tokens, preemptions, times); the joined
   request goes on a bounded queue. Its worker thread drains that queue and the KV events.

   Every choice and every request is a row. The ``n`` choices of one completion are ``n`` child requests in
   vLLM (``<index>_<parent id>``), and their ``FinishedRequestStats`` carry only the id they share (the
   client's, ``external_req_id``), so the map holds a queue per id: vLLM reports a request's stats in the
   order its output loop finished them, the order the hook saw them, so the first stats of an id belong to
   the first of its requests still waiting. An aborted request (its client went away) gets no stats: it is
   queued at once, with vLLM's own times read from its state. A request whose stats never come is
   written without them after :data:`STATS_WAIT_S`, and when the map is full the oldest waiting id is
   written without them at once (both counted in ``unjoined``; stats that come later for it are skipped,
   never joined to a sibling). Only a full ready queue, a record that cannot be built or one the trace
   writer drops or fails to write loses a row, and each is counted (:attr:`Observer.dropped_records`,
   ``sparseety:trace_records_dropped``).
2. :class:`.scheduler_consumer.SchedulerConsumer` / :class:`.scheduler_consumer.RequestTable`: the engine
   core's per-request records (prefill chunks, draft ids, KV bytes, owners) from the scheduler channel.
3. :class:`.kv_consumer.KVConsumer`: the KV-event subscriber; metrics, block index, ``vllm-prefix-cache``
   records.
4. :class:`.importance_consumer.ImportanceConsumer`: the worker's important tokens (waited for,
   forwarded to the API server that owns the request, attached).
5. :class:`.finisher.Finisher`: joins one finished request with 2-4 and writes it through
   :class:`.sink.TraceSink` (the project's :class:`~sparseety.store.TraceWriter`: same tables, same schema
   version; ``engine: vllm`` and the vLLM version in provenance).

Environment: ``SPARSEETY_TRACE_DIR`` (no store without it; metrics still count), ``SPARSEETY_SAMPLE_RATE``
(share of requests kept above tier 1, default 1), ``SPARSEETY_TIER`` (1: counts and timings; 2, the
default: ids and token events), ``SPARSEETY_KV_EVENTS`` (the KV-event endpoint to subscribe to;
default: the one vLLM's ``--kv-events-config`` publishes on, ``off`` to skip), ``SPARSEETY_QUEUE_SIZE``,
``SPARSEETY_REDACT`` and ``SPARSEETY_IDS_ONLY`` (as ``sparseety run --redact`` / ``--ids-only``);
parsed by :func:`.settings.parse_settings`. A bad one is logged in one line and turns tracing off.

At tier 2 the worker thread decodes each stored token's text with the served model's tokenizer (loaded
there on first use, never on vLLM's loop; not at all when ids-only). Records name the model by vLLM's
served model name (``--served-model-name``, else the model argument); the path is in provenance.

Nothing here may raise into vLLM: the hooks and the stat logger call in through guarded entry points
that log a hook's first failure (with its traceback) and count the rest (:func:`.hooks.guarded`).

Ranks and API servers: with ``--api-server-count N`` each API server runs its own observer (``client``,
vLLM's client index), records the requests it owns (vLLM routes a request's outputs to that one process)
and binds its own channel (:func:`.channels.client_channel`). Only API server 0 subscribes to the KV
events (every data-parallel rank's endpoint) and writes the ``vllm-prefix-cache`` records, one per rank
and window, so the cache is recorded once. A request's record carries the engine (DP rank) that served
it, from the per-engine stat logger that reported it; the ``sparseety:`` counters carry it as ``engine``.
The worker's importance results all reach API server 0, which forwards those of requests another API
server owns (the scheduler names the owner on the channel) to that server's importance channel.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.observe.finisher import Finisher
from sparseety.integrations.vllm.observe.importance_consumer import ImportanceConsumer
from sparseety.integrations.vllm.observe.kv_consumer import KVConsumer
from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest, FinishedStats
from sparseety.integrations.vllm.observe.routing_consumer import RoutingConsumer, routing_expected
from sparseety.integrations.vllm.observe.scheduler_consumer import RequestTable, SchedulerConsumer
from sparseety.integrations.vllm.transport.channels import client_channel_of
from sparseety.integrations.vllm.transport.settings import Settings, parse_settings
from sparseety.integrations.vllm.transport.sink import TraceSink, engine_label

log = logging.getLogger("sparseety.vllm")
CAPTURE_WAIT_S = 0.25  #: a finished request waits this long for its blocks' KV events before it is joined
STATS_WAIT_S = 30.0  #: a finished request whose stats have not come by then is recorded without them


class Observer:
    """One per API-server process; created by :func:`observer` when vLLM first reports to the plugin."""

    def __init__(self, settings: Settings | None = None, client: int = 0) -> None:
        self.settings = settings or parse_settings()
        self.client = client  #: this API server's index among vLLM's API servers (0 with one)
        if self.settings.message:
            log.warning(self.settings.message)
        self.has_stat_logger = False
        self.sink = TraceSink(self.settings, client)
        self.writer = self.sink.writer
        self.metrics = self.sink.metrics
        self.unjoined = 0  #: FinishedRequestStats with no request, or requests written without their stats
        self.failed_records = 0  #: requests lost because their record could not be read or built (an error)
        self._build_failures = 0  #: of those, records the finisher could not build (the first one is logged)
        self._dropped_ready = 0
        #: join id -> the requests waiting for the stat logger's stats, oldest first
        self._captures: OrderedDict[str, deque[FinishedRequest]] = OrderedDict()
        self._waiting = 0  #: requests in ``_captures``
        #: join id -> how many of its next stats belong to requests already written without them (bounded)
        self._skip: OrderedDict[str, int] = OrderedDict()
        #: guards the map between vLLM's loop (captures, stats) and the worker thread (stats that never came);
        #: held for a few dictionary operations, never while a record is built
        self._join_lock = threading.Lock()
        self._ready: deque[FinishedRequest] = deque()  #: joined, waiting for the worker thread
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.requests = RequestTable(4 * self.settings.queue_size)
        self._channel = client_channel_of(client)
        self.scheduler = SchedulerConsumer(self._channel, self.requests) if self._channel else None
        self.importance = ImportanceConsumer(self._channel, self.requests, client)
        self.kv = KVConsumer(self.sink)
        self.finisher = Finisher(self.sink, self.requests, self.kv, self.importance, channel=bool(self._channel))
        # the workers send to API server 0, which forwards other API servers' requests to them
        self.routing = RoutingConsumer(self._channel, owners=self.requests.route_owners if client == 0 else None)
        self.finisher.routing = self.routing
        atexit.register(self.close)

    @property
    def dropped_records(self) -> int:
        """Records lost: the ready queue was full, the record could not be built, or the trace writer refused
        it (its queue was full) or failed to write it."""
        return self._dropped_ready + self.failed_records + self.sink.dropped + self.sink.failed_records()

    # -- set-up from vLLM's config (stat logger) ------------------------------------------------------
    def configure(self, *, model: str, block_size: int | None, kv_endpoint: str | None,
                  config: dict[str, Any], tokenizer: str | None = None, model_path: str | None = None,
                  data_parallel_size: int = 1) -> None:
        """``model``: the served model name; ``tokenizer``: where vLLM loaded its tokenizer from (token
        texts); ``model_path``: vLLM's model argument (provenance); ``kv_endpoint``: rank 0's KV-event
        endpoint (rank ``r`` publishes on :func:`.kv_events.rank_endpoint`); only API server 0
        subscribes."""
        self.sink.configure(model=model, block_size=block_size, config=config, tokenizer=tokenizer,
                            model_path=model_path)
        self.routing.expected = routing_expected(model_path)
        endpoint = self.settings.kv_endpoint or kv_endpoint
        if endpoint and endpoint != "off" and self.client == 0:
            self.kv.subscribe(endpoint, data_parallel_size)
        self.start()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparseety-vllm-observer", daemon=True)
                self._thread.start()

    # -- hot path: called from vLLM's output loop, O(1) and never blocking ------------------------------
    def on_preempted(self, req_state: Any) -> None:
        adapter.mark_preempted(req_state)

    def on_finished(self, req_state: Any, finish_reason: Any) -> None:
        try:
            request = adapter.finished_request(req_state, finish_reason)
        except Exception:
            self._lost()  # counted, then raised for the hook's guard to log
            raise
        if self.has_stat_logger:
            with self._join_lock:
                if self._waiting >= self.settings.queue_size:
                    self._write_oldest_unjoined()  # the map is full: the oldest waits no longer, none is lost
                # the choices of one n > 1 completion share the id vLLM's stats carry, reported in this order
                self._captures.setdefault(request.join_id or request.request_id, deque()).append(request)
                self._waiting += 1
        else:
            self._enqueue(request)
        self.start()

    def on_aborted(self, req_state: Any) -> None:
        """A request vLLM dropped unfinished (its client went away, or it was aborted): recorded with what it
        produced, ``finish_reason`` ``abort`` and the times vLLM's state holds (vLLM reports no stats for it,
        so it is not held for them)."""
        try:
            request = adapter.aborted_request(req_state)
        except Exception:
            self._lost()
            raise
        self._enqueue(request)
        self.start()

    def on_finished_stats(self, finished: FinishedStats, engine: int | None = None) -> None:
        """Join vLLM's view of a finished request to the frontend's (stat-logger path); ``engine``: the
        index of the engine whose stat logger reported it (its data-parallel rank)."""
        key = finished.request_id
        with self._join_lock:
            if key in self._skip:  # the stats of a request already written without them: theirs, not a sibling's
                self._skip[key] -= 1
                if not self._skip[key]:
                    del self._skip[key]
                return
            waiting = self._captures.get(key)
            if not waiting:
                self.unjoined += 1
                return
            request = waiting.popleft()
            self._waiting -= 1
            if not waiting:
                del self._captures[key]
        request.engine = engine
        request.finish_reason = finished.finish_reason
        request.num_cached_tokens = finished.num_cached_tokens
        request.num_preemptions = finished.num_preemptions
        request.timings = dict(finished.timings)
        self._enqueue(request)

    def on_recomputed(self, tokens: int, engine: int | None = None) -> None:
        """vLLM's per-step prefix-cache stats: prompt tokens resumed (preempted) requests prefilled again."""
        if tokens > 0:
            self.metrics.recomputed_tokens.labels(engine=engine_label(engine)).inc(tokens)

    def _enqueue(self, request: FinishedRequest) -> None:
        if len(self._ready) >= self.settings.queue_size:
            self._dropped_ready += 1
            self.metrics.trace_dropped.inc()
            return
        self._ready.append(request)

    def _lost(self) -> None:
        """One request whose record cannot be read or built: counted as a dropped record."""
        self.failed_records += 1
        self.metrics.trace_dropped.inc()

    def _unjoined(self, key: str, request: FinishedRequest) -> None:
        """Under ``_join_lock``: write ``request`` (of join id ``key``, taken from the map) without its stats;
        its stats, if they come, are skipped."""
        self._waiting -= 1
        self.unjoined += 1
        self._skip[key] = self._skip.get(key, 0) + 1
        self._skip.move_to_end(key)
        while len(self._skip) > self.settings.queue_size:
            self._skip.popitem(last=False)
        self._enqueue(request)

    def _write_oldest_unjoined(self) -> None:
        """Under ``_join_lock``: the oldest request waiting for its stats is written without them."""
        key, waiting = next(iter(self._captures.items()))
        self._unjoined(key, waiting.popleft())
        if not waiting:
            del self._captures[key]

    # -- worker thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.process(final=False)
            except Exception:  # never let the observer take vLLM down
                log.exception("sparseety observer step failed")

    def process(self, final: bool) -> None:
        """Drain KV changes and finished requests (those old enough for their KV events, or all)."""
        self.kv.take()
        self._give_up_on_stats(time.monotonic() - STATS_WAIT_S)
        if self.requests.owners:
            self.importance.forward()
        now = time.monotonic()
        while self._ready and (final or self._ripe(self._ready[0], now)):
            self._finish(self._ready.popleft())
        self.kv.write(final)
        self.sink.count_failed()

    def _finish(self, request: FinishedRequest) -> None:
        """Write one record; one that cannot be built is counted (the first failure logged with its traceback),
        and the requests behind it go on."""
        try:
            self.finisher.finish(request)
        except Exception:
            self._lost()
            self._build_failures += 1
            if self._build_failures == 1:
                log.exception("sparseety: the record of request %s could not be built; it is dropped and counted "
                              "in sparseety:trace_records_dropped (later failures are counted, not logged)",
                              request.request_id)

    def _give_up_on_stats(self, before: float | None) -> None:
        """Requests finished before ``before`` (None: all) whose stats never came are recorded without them
        (counted in ``unjoined``), so none is held forever."""
        with self._join_lock:
            while self._captures:
                waiting = next(iter(self._captures.values()))
                if before is not None and waiting[0].finished_at >= before:
                    return
                self._write_oldest_unjoined()

    def _ripe(self, request: FinishedRequest, now: float) -> bool:
        """Old enough for its blocks' KV events, and no importance result still on its way."""
        if now - request.finished_at < CAPTURE_WAIT_S:
            return False
        sampled = self.client > 0 and self.settings.tier >= 2 and self.sink.sampled(request.request_id)
        if self.routing.pending(request.internal_id, request.finished_at, now):
            return False
        return not self.importance.pending(request, now, sampled=sampled)

    def stats(self) -> dict[str, Any]:
        return {"captures_waiting": self._waiting, "ready": len(self._ready),
                "dropped_records": self.dropped_records, "failed_records": self.failed_records,
                "dropped_chunk_requests": self.requests.dropped, "unjoined": self.unjoined, **self.kv.stats()}

    def flush(self) -> None:
        self.process(final=True)
        self.sink.flush()

    def close(self) -> None:
        try:
            self._close()
        except Exception:
            log.exception("sparseety: closing the observer failed")

    def _close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.scheduler is not None:
            self.scheduler.join(2)
        self.importance.close()
        self.routing.close()
        try:
            self._give_up_on_stats(None)  # never joined: keep what the frontend knew
            self.process(final=True)
        finally:
            self.kv.stop()
            self.sink.close()


_OBSERVER: Observer | None = None
_OBSERVER_LOCK = threading.Lock()


def observer(client: int = 0) -> Observer:
    """The process's observer (created on first use; ``client``: this API server's index, used then)."""
    global _OBSERVER
    with _OBSERVER_LOCK:
        if _OBSERVER is None:
            _OBSERVER = Observer(client=client)
        return _OBSERVER
