"""The token extractor: signals (attention, routing, activations) -> ranked token records."""

from __future__ import annotations

from pathlib import Path

from sparseety.extract.extractor import (
    Decoder,
    ExtractionResult,
    TokenIds,
    extract,
    extract_detailed,
    extract_ragged,
    extract_ragged_detailed,
)
from sparseety.extract.ingest import OfflineRecord, load_scores, read_records
from sparseety.extract.signals import Signal

__all__ = [
    "Decoder",
    "ExtractionResult",
    "OfflineRecord",
    "Signal",
    "TokenIds",
    "example_record_path",
    "extract",
    "extract_detailed",
    "extract_ragged",
    "extract_ragged_detailed",
    "load_scores",
    "read_records",
]


def example_record_path() -> Path:
    """The bundled example offline record (a JSON file next to its ``.npy`` attention matrix)."""
    return Path(__file__).resolve().parent.parent / "examples" / "record" / "record.json"
