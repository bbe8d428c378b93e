"""JSONL export of a trace dataset: one JSON object per row, tagged with its ``table``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import duckdb
import pyarrow as pa

from sparseety.errors import InputError, RecordError
from sparseety.store.reader import connect
from sparseety.store.tables import TABLES


def plain(value: Any) -> Any:
    """A DuckDB/Arrow value as strict JSON (NaN and infinities become null, times ISO strings)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def export_jsonl(trace_dir: str | Path, out: IO[str], *, tables: Iterable[str] = tuple(TABLES),
                 request_id: str | None = None) -> dict[str, int]:
    """Write every row of ``tables`` (of one request, or all) to ``out``; returns rows per table."""
    chosen = list(tables)
    unknown = [t for t in chosen if t not in TABLES]
    if unknown:
        raise InputError(f"unknown table {unknown[0]!r}: tables are {', '.join(TABLES)}")
    con = connect(trace_dir)
    counts: dict[str, int] = {}
    try:
        _write_rows(con, chosen, out, request_id, counts)
    except duckdb.Error as exc:
        raise _read_error(exc) from None
    finally:
        con.close()
    if request_id is not None and not counts.get("requests", 1) and "requests" in chosen:
        raise InputError(f"no request with id {request_id!r} in {trace_dir}")
    return counts


def _write_rows(con: duckdb.DuckDBPyConnection, chosen: list[str], out: IO[str], request_id: str | None,
                counts: dict[str, int]) -> None:
    for table in chosen:
        where, params = ("WHERE request_id = ?", [request_id]) if request_id is not None else ("", [])
        reader = con.sql(f"SELECT * FROM {table} {where}", params=params).to_arrow_reader(batch_size=4096)
        counts[table] = 0
        batches = iter(reader)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except (pa.ArrowException, OSError) as exc:  # a damaged file met mid-stream comes as an Arrow error
                raise _read_error(exc) from None
            for row in batch.to_pylist():
                out.write(json.dumps({"table": table, **plain(row)}, ensure_ascii=False) + "\n")
                counts[table] += 1


def _read_error(exc: BaseException) -> RecordError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RecordError(f"reading the trace dataset failed: {first} (run `sparseety traces check`)")
