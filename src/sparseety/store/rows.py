"""One :class:`RunResult` -> the rows it adds to each table (privacy and tier applied here, in memory).

Array mapping (recorded in a manifest inside ``document_json`` so reading restores every array):

- event groups ``<kind>.{step,layer,kv_head,position,token_id,score}`` (``evicted``, ``attended``,
  ``skipped``, ``pruned``, ``window``) -> ``token_events`` with ``event = <kind>``, except ``skipped``
  (``event = skipped``, ``reason = topk``) and ``window`` (``event = skipped``, ``reason = window``);
- ``drafted.{step,position,token_id,rejected}`` -> ``token_events`` with ``event`` ``draft_accepted``
  or ``draft_rejected``;
- every other array -> ``signals``, one row per leading index (see :data:`~sparseety.store.tables.SIGNALS`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from sparseety.schema import SCHEMA_VERSION
from sparseety.store.privacy import names_text, redact_text, redact_tokens, redact_value
from sparseety.store.tables import SIGNALS, TOKEN_EVENTS

if TYPE_CHECKING:
    from sparseety.engine.result import RunResult

EVENT_COLUMNS = ("step", "layer", "kv_head", "position", "token_id", "score")
#: Event groups stored under another event name, with a reason: ``group -> (event, reason)``.
EVENT_REASONS = {"skipped": ("skipped", "topk"), "window": ("skipped", "window")}
DRAFT_GROUP = "drafted"
DRAFT_COLUMNS = ("step", "position", "token_id", "rejected")
DRAFT_EVENTS = ("draft_accepted", "draft_rejected")
_ROUTER = re.compile(r"^router\.(\d+)$")
REDACTED_ID = -1
"""Token id stored for a token that overlapped a redacted secret (its id would spell the secret)."""


@dataclass(frozen=True)
class StoreOptions:
    """What the writer keeps: ``redact`` secrets (typed placeholders), ``ids_only`` (no text at all)."""

    redact: bool = False
    ids_only: bool = False


@dataclass
class RequestRows:
    """The rows one request adds, per dataset table: an Arrow table (columnar tables) or a list of
    row dicts (``requests``, ``important_tokens``: converted once per batch, which is much cheaper)."""

    request_id: str
    created_at: datetime
    tables: dict[str, pa.Table | list[dict[str, Any]]]

    def row_count(self) -> int:
        """Rows in the largest table."""
        return max(len(t) for t in self.tables.values())


def to_table(schema: pa.Schema, parts: list[pa.Table | list[dict[str, Any]]]) -> pa.Table:
    """One Arrow table of ``schema`` from Arrow tables and row-dict lists."""
    dicts = [row for part in parts if isinstance(part, list) for row in part]
    tables = [part for part in parts if isinstance(part, pa.Table)]
    if dicts:
        tables.append(pa.Table.from_pylist(dicts, schema=schema))
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def request_rows(
    result: RunResult,
    options: StoreOptions,
    *,
    sample_rate: float = 1.0,
    sampled: bool = True,
    extra: dict[str, Any] | None = None,
    created_at: datetime | None = None,
) -> RequestRows:
    """Convert ``result``; an unsampled request (``sampled`` False, run tier below 3) keeps tier 1 only.

    Tier 1 stores counts and timings; tier 2 and up store token ids, texts, events, important
    tokens and signals as the run recorded them.
    """
    created = created_at or datetime.now(UTC)
    if created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    tier = result.tier if (sampled or result.tier >= 3) else min(result.tier, 1)
    full = tier >= 2
    kept = _kept(result, options, full, extra)
    arrays = result.arrays if full else {}
    events, signals, manifest = _split_arrays(result.request_id, arrays, kept.token_ids if kept.masked else None)
    records = result.important_tokens if full else []
    document = _document(result, tier, manifest, full)
    request = _request_row(result, options, kept, tier=tier, created=created, sample_rate=sample_rate,
                           document=document)
    tables = {
        "requests": [request],
        "token_events": events,
        "important_tokens": _important(result.request_id, records, kept.token_ids, kept.texts, kept.masked, options),
        "signals": signals,
    }
    return RequestRows(result.request_id, created, {k: v for k, v in tables.items() if len(v)})


@dataclass
class _Kept:
    """What a request's rows may hold after ``--redact`` and ``--ids-only``."""

    token_ids: np.ndarray  #: (prompt + output,) int64; a redacted token's id is :data:`REDACTED_ID`
    texts: list[str] | None  #: one text per token (tier 2 and up), None when not stored
    text: str | None  #: the output text
    masked: dict[int, str]  #: position -> placeholder of each redacted token
    extra: dict[str, Any] | None  #: the caller's extra fields


def _kept(result: RunResult, options: StoreOptions, full: bool, extra: dict[str, Any] | None) -> _Kept:
    """Apply the privacy options to the token ids, the texts and ``extra``."""
    token_ids = np.asarray(result.prompt_ids + result.output_ids, dtype=np.int64)
    texts: list[str] | None = list(result.token_texts) if full and result.token_texts else None
    text: str | None = result.text
    masked: dict[int, str] = {}
    if options.redact:
        if texts is not None:
            texts, masked = redact_tokens(texts)
        text = redact_text(text) if text is not None else None
    if masked:
        token_ids = token_ids.copy()
        token_ids[[p for p in masked if p < len(token_ids)]] = REDACTED_ID
    if options.ids_only:
        texts, text = None, None
    if extra is not None and (options.redact or options.ids_only):
        extra = redact_value(extra, drop_text=options.ids_only) if options.redact else _drop_text(extra)
    return _Kept(token_ids, texts, text, masked, extra)


def _request_row(result: RunResult, options: StoreOptions, kept: _Kept, *, tier: int, created: datetime,
                 sample_rate: float, document: dict[str, Any]) -> dict[str, Any]:
    """The request's one row of the ``requests`` table."""
    full = tier >= 2
    prov = result.provenance or {}
    n_prompt = len(result.prompt_ids)
    return {
        "schema_version": SCHEMA_VERSION,
        "request_id": result.request_id,
        "created_at": created,
        "model": result.model,
        "model_revision": prov.get("model_revision"),
        "sparseety_version": prov.get("sparseety_version"),
        "transformers_version": prov.get("transformers_version"),
        "torch_version": prov.get("torch_version"),
        "policy": result.policy,
        "params_json": json.dumps(result.params, sort_keys=True, default=str),
        "budget": result.budget,
        "extraction_json": json.dumps(prov.get("extraction"), sort_keys=True, default=str),
        "tier": tier,
        "run_tier": result.tier,
        "sample_rate": float(sample_rate),
        "prompt_tokens": n_prompt,
        "completion_tokens": len(result.output_ids),
        "evicted_positions": result.evicted_positions,
        "eviction_events": result.eviction_events,
        "skipped_events": result.skipped_events,
        "draft_tokens": result.draft_tokens,
        "draft_rejected": result.draft_rejected,
        "kv_cache_bytes_peak": result.kv_cache_bytes_peak,
        "kv_cache_bytes_dense": result.kv_cache_bytes_dense,
        "prefill_s": float(result.prefill_s),
        "decode_s": float(result.decode_s),
        "prompt_token_ids": kept.token_ids[:n_prompt].tolist() if full else None,
        "output_token_ids": kept.token_ids[n_prompt:].tolist() if full else None,
        "text": kept.text if full else None,
        "token_texts": kept.texts,
        "redacted": options.redact,
        "ids_only": options.ids_only,
        "document_json": json.dumps(document, default=_json_default),
        "extra_json": None if kept.extra is None else json.dumps(kept.extra, default=_json_default),
    }


def _document(result: RunResult, tier: int, manifest: dict[str, Any], full: bool) -> dict[str, Any]:
    """The ``--json`` object without what has columns or rows of its own, plus provenance and the manifest."""
    document = result.to_json()
    for key in ("text", "output_token_ids", "important_tokens", "trace_path"):
        document.pop(key, None)
    document["tier"] = tier
    if not full:
        document["sparsity"]["kept_positions_final"] = None
    document["provenance"] = result.provenance
    document["arrays"] = manifest
    return document


def _split_arrays(request_id: str, arrays: dict[str, np.ndarray], masked_ids: np.ndarray | None
                  ) -> tuple[pa.Table, pa.Table, dict[str, Any]]:
    """Event groups -> token_events rows, the rest -> signals rows; plus the manifest to undo it."""
    manifest: dict[str, Any] = {}
    event_parts: list[dict[str, Any]] = []
    groups: dict[str, set[str]] = {}
    for name in arrays:
        prefix, _, column = name.rpartition(".")
        if prefix:
            groups.setdefault(prefix, set()).add(column)
    grouped: set[str] = set()
    for prefix, columns in groups.items():
        names = [f"{prefix}.{c}" for c in columns]
        if len({arrays[n].shape for n in names}) != 1 or arrays[names[0]].ndim != 1:
            continue
        n = len(arrays[names[0]])
        if columns == set(EVENT_COLUMNS):
            part = {c: arrays[f"{prefix}.{c}"] for c in EVENT_COLUMNS}
            event, reason = EVENT_REASONS.get(prefix, (prefix, None))
            part["event"] = np.full(n, event, dtype=object)
            if reason is not None:
                part["reason"] = np.full(n, reason, dtype=object)
        elif prefix == DRAFT_GROUP and columns == set(DRAFT_COLUMNS):
            part = {c: arrays[f"{prefix}.{c}"] for c in ("step", "position", "token_id")}
            part["event"] = np.where(arrays[f"{prefix}.rejected"] != 0, DRAFT_EVENTS[1], DRAFT_EVENTS[0]).astype(object)
        else:
            continue
        part["seq"] = np.arange(n, dtype=np.int64)
        if masked_ids is not None and n:
            position = np.asarray(part["position"], dtype=np.int64)
            inside = (position >= 0) & (position < len(masked_ids))
            part["token_id"] = np.where(inside, masked_ids[np.clip(position, 0, len(masked_ids) - 1)],
                                        part["token_id"])
        event_parts.append(part)
        grouped.update(names)
        manifest.update({name: _entry(arrays[name], "token_events", prefix) for name in names})
    events = _events_table(request_id, event_parts)

    signal_parts: list[pa.Table] = []
    for name, array in arrays.items():
        if name in grouped:
            continue
        manifest[name] = _entry(array, "signals", name)
        signal_parts.append(_signal_rows(request_id, name, np.asarray(array)))
    signals = pa.concat_tables(signal_parts) if signal_parts else SIGNALS.empty_table()
    return events, signals, manifest


def _entry(array: np.ndarray, table: str, group: str) -> dict[str, Any]:
    return {"table": table, "group": group, "dtype": np.asarray(array).dtype.str, "shape": list(np.shape(array))}


def _events_table(request_id: str, parts: list[dict[str, Any]]) -> pa.Table:
    if not parts:
        return TOKEN_EVENTS.empty_table()
    n = sum(len(p["seq"]) for p in parts)

    def column(name: str, dtype: type) -> pa.Array:
        chunks = [np.asarray(p[name], dtype=dtype) if name in p else None for p in parts]
        if all(c is not None for c in chunks):
            return pa.array(np.concatenate(chunks))
        mask = np.concatenate([np.zeros(len(p["seq"]), bool) if name in p else np.ones(len(p["seq"]), bool) for p in parts])
        values = np.concatenate([c if c is not None else np.zeros(len(p["seq"]), dtype) for c, p in zip(chunks, parts)])
        return pa.array(values, mask=mask)

    return pa.Table.from_arrays(
        [
            pa.array(np.full(n, request_id, dtype=object), pa.string()),
            pa.array(np.concatenate([p["event"] for p in parts]), pa.string()),
            column("seq", np.int64),
            column("step", np.int64),
            column("layer", np.int64),
            column("kv_head", np.int64),
            column("position", np.int64),
            column("token_id", np.int64),
            column("score", np.float32),
            pa.array(np.concatenate([p.get("reason", np.full(len(p["seq"]), None, dtype=object)) for p in parts]),
                     pa.string()),
        ],
        schema=TOKEN_EVENTS,
    )


def _signal_rows(request_id: str, name: str, array: np.ndarray) -> pa.Table:
    """``array`` as rows of its last axis (a scalar or a vector is one row)."""
    if array.ndim <= 1:
        n, width = 1, int(array.size)
    else:
        n, width = int(np.prod(array.shape[:-1])), int(array.shape[-1])
    index = np.arange(n, dtype=np.int64)
    layer = step = None
    kind = name
    router = _ROUTER.match(name)
    if router:
        kind, layer = "router", np.full(n, int(router.group(1)), dtype=np.int64)
    elif (name == "importance" or name.startswith("activation.")) and array.ndim == 2:
        layer = index
    elif name == "step_importance" and array.ndim == 3:
        step, layer = index // array.shape[1], index % array.shape[1]
    integer = array.dtype.kind in "biu"
    flat = array.reshape(-1).astype(np.int64 if integer else np.float32)
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
    lists = pa.ListArray.from_arrays(offsets, pa.array(flat))
    return pa.Table.from_arrays(
        [
            pa.array(np.full(n, request_id, dtype=object), pa.string()),
            pa.array(np.full(n, name, dtype=object), pa.string()),
            pa.array(np.full(n, kind, dtype=object), pa.string()),
            pa.array(index),
            pa.nulls(n, pa.int64()) if layer is None else pa.array(layer),
            pa.nulls(n, pa.int64()) if step is None else pa.array(step),
            pa.nulls(n, pa.list_(pa.float32())) if integer else lists,
            lists if integer else pa.nulls(n, pa.list_(pa.int64())),
        ],
        schema=SIGNALS,
    )


def _important(request_id: str, records: list, token_ids: np.ndarray, texts: list[str] | None,
               masked: dict[int, str], options: StoreOptions) -> list[dict[str, Any]]:
    rows = []
    for seq, record in enumerate(records):
        row = record.to_dict()
        position = row["position"]
        if options.ids_only:
            row["text"] = None
        elif position in masked:
            row["text"] = masked[position]
        elif options.redact and row["text"] is not None:
            row["text"] = redact_text(row["text"])
        if masked and 0 <= position < len(token_ids):
            row["token_id"] = int(token_ids[position])
        experts = row.pop("experts", None)
        row["experts"] = None if experts is None else [{"expert_id": int(e), "prob": float(p)} for e, p in experts]
        row.update(request_id=request_id, seq=seq)
        rows.append(row)
    return rows


def _drop_text(value: Any) -> Any:
    """ids-only without redaction: text-named fields become None, everything else is kept."""
    if isinstance(value, dict):
        return {k: None if names_text(str(k)) else _drop_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_drop_text(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
