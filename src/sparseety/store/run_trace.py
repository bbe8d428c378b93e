"""Compatibility with the first trace API: ``load_run_trace(path) -> (document, arrays)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sparseety.store.reader import load_trace


def load_run_trace(path: str | Path, request_id: str | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The document and arrays of one stored request (see :func:`sparseety.store.load_trace`)."""
    trace = load_trace(path, request_id)
    return trace.document, trace.arrays
