"""The trace store: a Parquet dataset written asynchronously, read back by DuckDB.

Write with :class:`TraceWriter` (serving) or :func:`write_trace` (one run); read with
:func:`load_trace`, :func:`list_traces` and :func:`connect` (SQL views).
"""

from sparseety.store.reader import StoredTrace, connect, list_traces, load_trace
from sparseety.store.run_trace import load_run_trace
from sparseety.store.sampling import should_sample, trace_tier
from sparseety.store.writer import Commit, TraceWriter, WriterStats, write_trace

__all__ = [
    "Commit",
    "StoredTrace",
    "TraceWriter",
    "WriterStats",
    "connect",
    "list_traces",
    "load_run_trace",
    "load_trace",
    "should_sample",
    "trace_tier",
    "write_trace",
]
