"""Trace storage: write a run, read it back (see :mod:`sparseety.store.trace` for the contract)."""

from sparseety.store.run_trace import load_run_trace, write_run_trace
from sparseety.store.trace import StoredTrace, load_trace, write_trace

__all__ = ["StoredTrace", "load_trace", "write_trace", "load_run_trace", "write_run_trace"]
