"""SparSEEty inside vLLM: per-request token lifecycle, prefix-cache blocks and metrics into the trace store.

Install into vLLM's environment with ``scripts/setup-vllm.sh`` (or ``pip install --no-deps -e .`` plus the
``vllm`` extra's packages); vLLM then loads :func:`.plugin.register` (``vllm.general_plugins``) and
:class:`.stat_logger.SparseetyStatLogger` (``vllm.stat_logger_plugins``) by entry point. Run::

    SPARSEETY_TRACE_DIR=traces vllm serve MODEL --enable-prefix-caching \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}'

This package's import path needs only msgspec, pyzmq, prometheus-client, numpy and pyarrow (and duckdb,
which ``sparseety.store`` imports); only :mod:`.adapter` touches vLLM's objects (importing vLLM when it checks or
reads them), and :mod:`.stat_logger` subclasses vLLM's base class through it. ``docs/vllm.md`` draws the data flow.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"BlockIndex": "kv_events", "KVEventSubscriber": "kv_events", "decode_batch": "kv_events",
            "KV_POLICY": "record", "VllmRun": "record"}
__all__ = ["KV_POLICY", "BlockIndex", "KVEventSubscriber", "VllmRun", "decode_batch"]


def __getattr__(name: str) -> Any:
    """The exports, imported on first use (so :mod:`.attention_capture`'s math imports without msgspec)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
