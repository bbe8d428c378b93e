"""What a report is made from: a stored trace, or a ``bench passkey`` / ``tune`` JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparseety.errors import QueryLimitError, RecordError
from sparseety.schema import SCHEMA_VERSION
from sparseety.store import StoredTrace, load_trace

BENCH_KINDS = ("passkey", "ruler", "faithfulness", "tune")


def load_source(source: StoredTrace | str | Path, request_id: str | None = None) -> StoredTrace | dict[str, Any]:
    """Return the trace (schema checked) or the bench/tune document behind ``source``.

    Raises
    ------
    RecordError
        ``source`` is neither a trace nor a passkey/tune JSON file, or its schema major version differs.
    """
    if isinstance(source, StoredTrace):
        check_schema(source)
        return source
    path = Path(source)
    if not path.exists():
        raise RecordError(f"{path} does not exist")
    if path.is_file() and path.suffix == ".json":
        document = _read_json(path)
        if isinstance(document, dict) and document.get("kind") in BENCH_KINDS:
            return document
    try:
        trace = load_trace(path, request_id)
    except (RecordError, QueryLimitError):  # a limit of the SQL sandbox: its own message
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RecordError(f"{path} is not a trace, a trace directory or a passkey/tune JSON file ({exc})") from None
    check_schema(trace)
    return trace


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path} is not a trace or a passkey/tune JSON file: {exc}") from None


def schema_version(trace: StoredTrace) -> str | None:
    """The schema version a trace was written with (top level, or in its provenance)."""
    document = trace.document
    version = document.get("schema_version") or (document.get("provenance") or {}).get("schema_version")
    return None if version is None else str(version)


def check_schema(trace: StoredTrace) -> None:
    """Refuse a trace that is not a run trace or whose schema major version differs from this SparSEEty's."""
    for key in ("request_id", "tier", "usage"):
        if key not in trace.document:
            raise RecordError(f"trace at {trace.path} has no {key!r}: not a run trace")
    version = schema_version(trace)
    if version is None:
        return
    ours = SCHEMA_VERSION.split(".")[0]
    theirs = version.split(".")[0]
    if theirs != ours:
        age = "older" if _as_int(theirs) < _as_int(ours) else "newer"
        raise RecordError(
            f"trace {trace.request_id} has schema version {version}, an {age} major version than this "
            f"SparSEEty reads ({SCHEMA_VERSION}); use a matching SparSEEty version to report on it"
        )


def _as_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0
