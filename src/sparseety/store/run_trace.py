"""Write one run as ``<trace_dir>/<request_id>/trace.json`` plus ``arrays.npz``, atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from sparseety.engine.result import RunResult
from sparseety.errors import RecordError

TRACE_FILE = "trace.json"
ARRAYS_FILE = "arrays.npz"


def write_run_trace(result: RunResult, trace_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Store ``result`` under ``trace_dir`` and return the trace folder; sets ``result.trace_path``.

    The folder is written under a temporary name and renamed into place, so a reader never sees
    half a trace. ``trace.json`` holds the ``--json`` object plus provenance, prompt ids and the
    array index; ``arrays.npz`` holds eviction events, importance vectors, router probabilities.
    """
    root = Path(trace_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / result.request_id
    result.trace_path = str(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{result.request_id}.", dir=root))
    try:
        document: dict[str, Any] = result.to_json()
        document["prompt_token_ids"] = result.prompt_ids
        document["token_texts"] = result.token_texts
        document["provenance"] = result.provenance
        document.update(extra or {})
        document["arrays"] = {name: list(array.shape) for name, array in result.arrays.items()}
        (tmp / TRACE_FILE).write_text(json.dumps(document, indent=1))
        np.savez_compressed(tmp / ARRAYS_FILE, **result.arrays)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_run_trace(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a trace folder back: the JSON document and its arrays (``allow_pickle=False``)."""
    folder = Path(path)
    doc_path = folder / TRACE_FILE
    if not doc_path.is_file():
        raise RecordError(f"{folder} is not a run trace (no {TRACE_FILE})")
    document = json.loads(doc_path.read_text())
    with np.load(folder / ARRAYS_FILE, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    return document, arrays
