"""In the API server: one finished request, joined with what the other sources said, written as its record.

:class:`Finisher` takes a :class:`.messages.FinishedRequest` (the frontend's view, completed by the stat
logger), counts it in the ``sparseety:`` metrics, and joins by request id:

- the engine core's records (:class:`.scheduler_consumer.RequestTable`: prefill chunks, draft
  identities, the KV bytes held), by vLLM's internal id;
- the prefix-cache blocks its prompt used (:class:`.kv_consumer.KVConsumer`), on the engine that served it;
- the worker's important tokens (:class:`.importance_consumer.ImportanceConsumer`), at tier 2 and above;

then decodes the token texts (the served model's tokenizer, loaded here on first use, never on vLLM's
loop) and submits one :class:`.record.VllmRun` through the :class:`.sink.TraceSink`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from sparseety.integrations.vllm.observe.importance_consumer import ImportanceConsumer
from sparseety.integrations.vllm.observe.kv_consumer import KVConsumer
from sparseety.integrations.vllm.observe.kv_events import hash_text
from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest
from sparseety.integrations.vllm.transport.record import EventGroup, VllmRun, draft_arrays, draft_identity_arrays, kept_after
from sparseety.integrations.vllm.observe.scheduler_consumer import RequestTable
from sparseety.integrations.vllm.transport.sink import TraceSink, engine_label
from sparseety.integrations.vllm.observe.window_rows import freed, layer_windows, window_events

log = logging.getLogger("sparseety.vllm")


def _prefill_arrays(chunks: list[tuple[int, int]], sequence: list[int]) -> dict[str, Any]:
    group = EventGroup()
    for index, (start, n) in enumerate(chunks):
        token = sequence[start] if 0 <= start < len(sequence) else -1
        group.add(index, -1, start, token, float(n))
    return group.arrays("prefill_chunk")


def _token_arrays(c: FinishedRequest, blocks: list[Any], chunks: list[tuple[int, int]],
                  drafts: list[tuple[int, int, list[int], int]]) -> dict[str, Any]:
    """The tier-2 token events: prefill chunks, cached and stored prompt positions, recomputed ones, drafts."""
    sequence = c.prompt_ids + c.output_ids
    arrays: dict[str, Any] = _prefill_arrays(chunks, sequence) if chunks else {}
    cached = EventGroup()
    cached.extend_positions(0, -1, 0, c.prompt_ids[: c.num_cached_tokens])
    stored = EventGroup()
    for depth, block in enumerate(blocks):
        start = depth * len(block.token_ids)
        if start >= c.num_cached_tokens:
            stored.extend_positions(block.stored_seq, depth, start, block.token_ids, block.stored_ts)
    recomputed = EventGroup()
    for n in c.preempted_at:
        recomputed.extend_positions(n, -1, 0, sequence[: len(c.prompt_ids) + n])
    for kind, group in (("cached", cached), ("kv_stored", stored), ("recomputed", recomputed)):
        if len(group):
            arrays.update(group.arrays(kind))
    if drafts:
        arrays.update(draft_identity_arrays(drafts))
    elif c.per_step_drafted is not None and c.per_step_accepted is not None:
        arrays.update(draft_arrays(c.per_step_drafted, c.per_step_accepted))
    return arrays


def _attach_evictions(run: VllmRun, eviction: dict[str, Any], sequence: list[int], tier: int,
                      shape: tuple[int, int] | None) -> None:
    """The slots the request's policy evicted inside vLLM's cache, as the own engine records them: ``evicted``
    token events and ``kept_positions_final`` (tier 2; ``shape``: layers and KV heads), ``evicted_positions``
    (distinct positions evicted from some layer and head) and ``eviction_events`` (tier 1); the ``slots`` leave
    the ``vllm`` info (they are in the events)."""
    slots = eviction.pop("slots", None)
    if tier < 1 or slots is None or not len(slots):
        return
    table = np.column_stack([np.asarray(column, dtype=np.float64) for column in
                             (slots.step, slots.layer, slots.kv_head, slots.position, slots.score)])
    positions = table[:, 3].astype(np.int64)
    run.evicted_positions = int(np.unique(positions).size)
    run.eviction_events = int(table.shape[0])
    if tier >= 2:
        ids = np.asarray(sequence, dtype=np.int64)
        known = (positions >= 0) & (positions < ids.size)
        run.arrays.update({
            "evicted.step": table[:, 0].astype(np.int64), "evicted.layer": table[:, 1].astype(np.int64),
            "evicted.kv_head": table[:, 2].astype(np.int64), "evicted.position": positions,
            "evicted.token_id": np.where(known, ids[np.clip(positions, 0, max(ids.size - 1, 0))], -1),
            "evicted.score": table[:, 4].astype(np.float32),
        })
        if shape is not None:
            run.kept_positions_final = kept_after(table, shape, len(sequence) - 1)


def evicting_peak(held: list[int] | None, eviction: dict[str, Any], block_size: int | None,
                  tokens: int) -> list[int] | None:
    """``[peak bytes, peak blocks, dense bytes]`` of a request that evicted inside vLLM's cache: vLLM freed its
    compacted blocks at the end, so its peak is the most tokens it held at once (before a compaction), and its
    dense figure the blocks its ``tokens`` tokens would have held without eviction."""
    if not held or not held[1] or not block_size:
        return held
    per_block = held[0] // held[1]
    peak_blocks = max(held[1], -(-eviction["peak_tokens"] // block_size))
    dense_blocks = -(-tokens // block_size)
    return [peak_blocks * per_block, peak_blocks, dense_blocks * per_block]


def _own_part(c: FinishedRequest, part: str, attach: Any, *args: Any, result: bool = False) -> Any:
    """``attach(*args)``: one part of ``c``'s record, whose failure costs that part only, never the record
    (``{"status": "failed", "error"}`` instead; logged). ``result``: return what ``attach`` returned."""
    try:
        out = attach(*args)
        return out if result else None
    except Exception as e:
        log.exception("sparseety: the %s of request %s could not be recorded; the rest of its record is kept",
                      part, c.request_id)
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"[:400]}


class Finisher:
    """Writes each finished request's record (in the observer's worker thread)."""

    routing: Any = None  #: the :class:`.routing_consumer.RoutingConsumer` (MoE routing), set by the observer

    def __init__(self, sink: TraceSink, table: RequestTable, kv: KVConsumer, importance: ImportanceConsumer,
                 *, channel: bool) -> None:
        self.sink = sink
        self.table = table
        self.kv = kv
        self.importance = importance
        self.channel = channel  #: whether the engine core's records can come (a scheduler channel is set)
        self._tokenizer: Any = None  #: loaded on first use; False when it cannot load
        self._token_text: dict[int, str] = {}

    def count(self, c: FinishedRequest) -> tuple[int, int]:
        """Count ``c`` in the ``sparseety:`` metrics; ``(preemptions, recomputed tokens)``."""
        m = self.sink.metrics
        engine = engine_label(c.engine)
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
        return preemptions, recomputed

    def finish(self, c: FinishedRequest) -> None:
        """Count ``c`` and, with a trace store, write its record."""
        preemptions, recomputed = self.count(c)
        chunks, drafts, held, frees = self.table.take(c.internal_id)
        eviction = self.table.take_eviction(c.internal_id)
        evicted = eviction if eviction is not None and "refused" not in eviction else None
        if eviction is not None:
            labels = {"engine": engine_label(c.engine), "policy": eviction["policy"]}
            m = self.sink.metrics
            if evicted is None:
                m.eviction_refused.labels(**labels).inc()
            else:
                m.evicted_tokens.labels(**labels).inc(evicted["evicted_tokens_per_layer"])
                m.evicted_freed_blocks.labels(**labels).inc(evicted["freed_blocks"])
                if evicted["failure"] is not None:
                    m.eviction_failures.labels(**labels).inc()
                # the KV written: prompt and every output but the last (never fed), as vLLM's block table and the own engine
                held = evicting_peak(held, evicted, self.sink.block_size,
                                     len(c.prompt_ids) + max(len(c.output_ids), 1) - 1)
        groups = self.table.groups or []
        window = freed(groups, frees, len(c.prompt_ids)) if frees or layer_windows(groups) else None
        if window is not None:
            engine = engine_label(c.engine)
            self.sink.metrics.window_freed_blocks.labels(engine=engine).inc(window["freed_blocks"])
            self.sink.metrics.window_freed_bytes.labels(engine=engine).inc(window["freed_bytes"])
        if self.sink.writer is None:
            return
        tier = min(self.sink.settings.tier, 2)  # tier 3 only for sampled requests, with their importance
        blocks = self.kv.prompt_blocks(c.prompt_ids, c.request_id, c.engine or 0)
        info = self._info(c, preemptions, recomputed, blocks, chunks, drafts, held)
        info["window"] = window
        info["eviction"] = eviction
        sequence_ids = c.prompt_ids + c.output_ids
        rows, skipped = window_events(groups, sequence_ids, len(c.prompt_ids), len(c.output_ids)) if window else ({}, None)
        sequence = c.prompt_ids + c.output_ids
        sink = self.sink
        run = VllmRun(
            request_id=c.request_id, model=sink.model, prompt_ids=c.prompt_ids, output_ids=c.output_ids,
            tier=tier, text=c.text, params=sink.params(),
            **({"policy": evicted["policy"], "budget": evicted["budget"]} if evicted else {}),
            kv_cache_bytes_peak=held[0] if held else None,
            kv_cache_bytes_dense=held[2] if held else None,
            skipped_events=skipped,
            token_texts=self.texts(sequence) if tier >= 2 and sink.sampled(c.request_id) else [],
            draft_tokens=c.num_draft_tokens, draft_rejected=c.num_draft_tokens - c.num_accepted_tokens,
            prefill_s=c.timings.get("prefill_s", 0.0), decode_s=c.timings.get("decode_s", 0.0),
            provenance=sink.provenance(),
            arrays={**_token_arrays(c, blocks, chunks, drafts), **rows} if tier >= 2 else {},
            vllm=info,
        )
        if evicted is not None:
            shape = (sum(len(g.layers) for g in groups), groups[0].kv_heads) if groups else None
            failed = _own_part(c, "evicted slots", _attach_evictions, run, evicted, sequence, tier, shape)
            if failed is not None:  # the record keeps its counts; only the slots are lost
                evicted.pop("slots", None)
                evicted["slots_error"] = failed["error"]
        if tier >= 2:
            info["importance"] = self.importance.attach(
                run, c, decode=not sink.settings.ids_only, tokenizer_path=sink.tokenizer_path or sink.config.get(
                    "model_path"))
        if self.routing is not None:
            moe = _own_part(c, "expert routing", self.routing.attach, run, c.internal_id, result=True)
            if moe is not None:
                info["moe"] = moe
        sink.submit(run, {"vllm": info})

    def _info(self, c: FinishedRequest, preemptions: int, recomputed: int, blocks: list[Any],
              chunks: list[tuple[int, int]], drafts: list, held: list[int] | None) -> dict[str, Any]:
        """The record's ``extra_json.vllm``: what vLLM said about the request."""
        return {
            "num_cached_tokens": c.num_cached_tokens,
            "num_preemptions": preemptions,
            "preempted_at_output_tokens": c.preempted_at,
            "recomputed_tokens": recomputed,
            "finish_reason": c.finish_reason,
            "choice": c.choice,  #: with n > 1: which choice this row is (its id: ``<choice>_<completion id>``)
            "completion_id": c.join_id or c.request_id,
            "timings": c.timings,
            "spec_decode": None if not c.num_draft_tokens and c.per_step_drafted is None else {
                "num_draft_tokens": c.num_draft_tokens,
                "num_accepted_tokens": c.num_accepted_tokens,
                "num_rejected_tokens": c.num_draft_tokens - c.num_accepted_tokens,
                "per_step_drafted": c.per_step_drafted,
                "per_step_accepted": c.per_step_accepted,
            },
            "prefix_cache_blocks": [hash_text(b.block_hash) for b in blocks],
            "prefill_chunks": [[start, n] for start, n in chunks] if self.channel else None,
            "block_size": self.sink.block_size,
            "kv_blocks_held": held[1] if held else None,
            "draft_ids_recorded": bool(drafts),
            "data_parallel_rank": c.engine,
            "api_server": self.sink.client,
        }

    def texts(self, token_ids: list[int]) -> list[str]:
        """The text of each token (decoded one by one, as SparSEEty's own engine does), in the worker
        thread, never on vLLM's loop; empty when the trace is ids-only or the tokenizer cannot load."""
        if self.sink.settings.ids_only or not token_ids:
            return []
        if self._tokenizer is None:
            self._tokenizer = False
            path = self.sink.tokenizer_path
            if path:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(path)
                except Exception as e:
                    log.warning("sparseety: cannot load the tokenizer at %r (%s: %s); traces keep token ids "
                                "without texts", path, type(e).__name__, e)
        if self._tokenizer is False:
            return []
        known = self._token_text
        missing = sorted({int(t) for t in token_ids} - known.keys())
        if missing:
            known.update(zip(missing, self._tokenizer.batch_decode([[t] for t in missing]), strict=True))
        return [known[int(t)] for t in token_ids]
