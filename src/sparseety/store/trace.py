"""The contract every reader of a stored run relies on: :class:`StoredTrace`, :func:`write_trace`, :func:`load_trace`.

Report, bias analysis, replay and the server read runs only through these names, so the storage
layout behind them (today one folder per run; the Parquet dataset of the trace-store issue) can
change without touching them.

``StoredTrace.document`` is the ``sparseety run --json`` object plus ``prompt_token_ids``,
``token_texts`` (text per position, empty when ids-only), ``provenance`` and any ``extra`` sections a
command attached (``compare`` attaches ``{"compare": {...}}``). ``StoredTrace.arrays`` holds the
columnar arrays of :attr:`RunResult.arrays`: ``evicted.{step,layer,kv_head,position,token_id,score}``,
``attended.*``, ``skipped.*``, ``importance`` ``[layers, positions]``, ``router.<layer>``
``[tokens, experts]``, ``activation.maxabs`` / ``activation.zero_frac`` ``[layers, tokens]``,
``step_importance`` ``[steps, layers, positions]`` (tier 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparseety.engine.result import RunResult
from sparseety.errors import RecordError
from sparseety.store.run_trace import TRACE_FILE, load_run_trace, write_run_trace


@dataclass
class StoredTrace:
    """One stored run: its JSON document and its arrays."""

    document: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: Path

    @property
    def request_id(self) -> str:
        return str(self.document["request_id"])

    @property
    def tier(self) -> int:
        return int(self.document["tier"])


def write_trace(result: RunResult, trace_dir: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
    """Store ``result`` (plus ``extra`` document sections) under ``trace_dir``; returns where it went."""
    return write_run_trace(result, trace_dir, extra=extra)


def load_trace(path: str | Path, request_id: str | None = None) -> StoredTrace:
    """Read one run from a trace path or trace directory.

    ``request_id`` picks a run inside a directory; without it, the most recently written run.
    """
    root = Path(path)
    if not root.exists():
        raise RecordError(f"trace path {root} does not exist")
    if request_id is not None:
        folder = root / request_id
        if not (folder / TRACE_FILE).is_file():
            raise RecordError(f"no trace for request id {request_id!r} in {root}")
    elif (root / TRACE_FILE).is_file():
        folder = root
    else:
        runs = sorted((p for p in root.iterdir() if (p / TRACE_FILE).is_file()), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise RecordError(f"{root} is not a trace or a trace directory (no runs in it)")
        folder = runs[-1]
    document, arrays = load_run_trace(folder)
    return StoredTrace(document=document, arrays=arrays, path=folder)
