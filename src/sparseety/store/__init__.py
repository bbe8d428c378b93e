"""The trace store: a Parquet dataset written asynchronously, read back by DuckDB.

Write with :class:`TraceWriter` (serving) or :func:`write_trace` (one run); read with
:func:`load_trace`, :func:`list_traces` and :func:`connect` (SQL views).

Report, bias analysis, replay and the server read runs only through :class:`StoredTrace`.
``StoredTrace.document`` is the ``sparseety run --json`` object plus ``prompt_token_ids``,
``token_texts`` (text per position, empty when ids-only), ``provenance`` and any ``extra`` sections a
command attached (``compare`` attaches ``{"compare": {...}}``). ``StoredTrace.arrays`` holds the
columnar arrays of :attr:`RunResult.arrays`: ``evicted.{step,layer,kv_head,position,token_id,score}``,
``attended.*``, ``skipped.*``, ``pruned.*``, ``drafted.{step,position,token_id,rejected}``,
``importance`` ``[layers, positions]``, ``router.<layer>`` ``[tokens, experts]``,
``activation.maxabs`` / ``activation.zero_frac`` ``[layers, tokens]``, ``step_importance``
``[steps, layers, positions]`` (tier 3).
"""

from sparseety.store.reader import StoredTrace, connect, list_traces, load_trace
from sparseety.store.sampling import should_sample, trace_tier
from sparseety.store.writer import Commit, TraceWriter, WriterStats, write_trace

__all__ = [
    "Commit",
    "StoredTrace",
    "TraceWriter",
    "WriterStats",
    "connect",
    "list_traces",
    "load_trace",
    "should_sample",
    "trace_tier",
    "write_trace",
]
