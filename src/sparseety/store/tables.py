"""The four tables of a trace dataset, as explicit Arrow schemas of plain types.

Every Parquet file carries ``sparseety.schema_version`` and ``sparseety.table`` in its key-value
metadata; ``requests`` also carries the version as a column. The Hive partition column ``date``
lives in the folder name (``date=YYYY-MM-DD``), never inside a file.
"""

from __future__ import annotations

import pyarrow as pa

from sparseety.schema import SCHEMA_VERSION

VERSION_KEY = b"sparseety.schema_version"
TABLE_KEY = b"sparseety.table"

REQUESTS = pa.schema([
    pa.field("schema_version", pa.string(), nullable=False),
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("model", pa.string()),
    pa.field("model_revision", pa.string()),
    pa.field("sparseety_version", pa.string()),
    pa.field("transformers_version", pa.string()),
    pa.field("torch_version", pa.string()),
    pa.field("policy", pa.string()),
    pa.field("params_json", pa.string()),
    pa.field("budget", pa.int64()),
    pa.field("extraction_json", pa.string()),
    pa.field("tier", pa.int32(), nullable=False),
    pa.field("run_tier", pa.int32(), nullable=False),
    pa.field("sample_rate", pa.float64(), nullable=False),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("evicted_positions", pa.int64()),
    pa.field("eviction_events", pa.int64()),
    pa.field("skipped_events", pa.int64()),
    pa.field("draft_tokens", pa.int64()),
    pa.field("draft_rejected", pa.int64()),
    pa.field("kv_cache_bytes_peak", pa.int64()),
    pa.field("kv_cache_bytes_dense", pa.int64()),
    pa.field("prefill_s", pa.float64()),
    pa.field("decode_s", pa.float64()),
    pa.field("prompt_token_ids", pa.list_(pa.int64())),
    pa.field("output_token_ids", pa.list_(pa.int64())),
    pa.field("text", pa.string()),
    pa.field("token_texts", pa.list_(pa.string())),
    pa.field("redacted", pa.bool_(), nullable=False),
    pa.field("ids_only", pa.bool_(), nullable=False),
    pa.field("document_json", pa.string(), nullable=False),
    pa.field("extra_json", pa.string()),
])
"""One row per request. ``tier`` is what was stored, ``run_tier`` what the engine recorded; token
ids and texts are stored from tier 2 on; ``document_json`` holds the rest of the ``run --json``
object (sparsity, timings, provenance, the array manifest); ``extra_json`` the ``extra`` sections."""

TOKEN_EVENTS = pa.schema([
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("event", pa.string(), nullable=False),
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("step", pa.int64()),
    pa.field("layer", pa.int64()),
    pa.field("kv_head", pa.int64()),
    pa.field("position", pa.int64()),
    pa.field("token_id", pa.int64()),
    pa.field("score", pa.float32()),
    pa.field("reason", pa.string()),
])
"""One row per token event: ``evicted``, ``attended``, ``skipped``, ``pruned``, ``draft_accepted``,
``draft_rejected``; ``seq`` orders one request's events of one kind; ``kv_head`` -1 = all heads.

``reason`` says why a ``skipped`` token was not seen: ``topk`` (attention top-k left it out; one row
per position) or ``window`` (a sliding-window layer: one row per step and layer whose ``position`` is
the window edge, the first position the step's newest query still saw; every position below it was
hidden). Files written before the column existed read it as NULL."""

IMPORTANT_TOKENS = pa.schema([
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("rank", pa.int64(), nullable=False),
    pa.field("token_id", pa.int64(), nullable=False),
    pa.field("position", pa.int64(), nullable=False),
    pa.field("score", pa.float64(), nullable=False),
    pa.field("layer", pa.int64()),
    pa.field("step", pa.int64()),
    pa.field("head", pa.int64()),
    pa.field("token_type", pa.string(), nullable=False),
    pa.field("text", pa.string()),
    pa.field("experts", pa.list_(pa.struct([("expert_id", pa.int64()), ("prob", pa.float64())]))),
    pa.field("seq", pa.int64(), nullable=False),
])
"""The extractor's records (:class:`~sparseety.schema.TokenRecord`) with the request id."""

SIGNALS = pa.schema([
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("name", pa.string(), nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("row", pa.int64(), nullable=False),
    pa.field("layer", pa.int64()),
    pa.field("step", pa.int64()),
    pa.field("values", pa.list_(pa.float32())),
    pa.field("int_values", pa.list_(pa.int64())),
])
"""Vectors, one row per leading index of an array (its last axis in ``values``, or ``int_values``
for integer arrays): ``importance`` (layer = row), ``step_importance`` (step = forward, layer),
``router`` (layer from the name, row = token fed), ``activation.*`` (layer = row), and any other array."""

TABLES: dict[str, pa.Schema] = {
    "requests": REQUESTS,
    "token_events": TOKEN_EVENTS,
    "important_tokens": IMPORTANT_TOKENS,
    "signals": SIGNALS,
}


def file_schema(table: str) -> pa.Schema:
    """The schema written to disk for ``table``, with the version and table name in its metadata."""
    return TABLES[table].with_metadata({VERSION_KEY: SCHEMA_VERSION.encode(), TABLE_KEY: table.encode()})
