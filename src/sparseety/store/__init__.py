"""Trace storage. Until the Parquet store lands, a run trace is JSON plus NumPy arrays."""

from sparseety.store.run_trace import load_run_trace, write_run_trace

__all__ = ["load_run_trace", "write_run_trace"]
