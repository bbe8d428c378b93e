"""The on-disk layout of a trace dataset and its version marker.

``<trace_dir>/_sparseety_dataset.json`` marks a dataset (format and ``schema_version``); data
files are ``<trace_dir>/<table>/date=YYYY-MM-DD/part-<uuid>.parquet``. Each file is written to a
dot-prefixed temporary name in its folder and renamed into place, so readers (which glob
``part-*.parquet``; pyarrow and Spark skip dot files anyway) never see half a file. A marker with
``commit_log`` means readers take only the files a commit manifest names (:mod:`sparseety.store.commits`).
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import date
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sparseety.errors import RecordError
from sparseety.schema import SCHEMA_VERSION
from sparseety.store.commits import COMMITS_DIR, write_manifest
from sparseety.store.tables import TABLES, file_schema

MARKER = "_sparseety_dataset.json"
FORMAT = "sparseety-trace-dataset"
TEMP_PREFIX = ".part-"
QUARANTINE = "_quarantine"
MIN_FREE_BYTES = 64 << 20
"""Free space :func:`check_trace_dir` asks for (a tier-2 trace of a short run is tens of KiB, tier 3 a few MiB)."""


def major(version: str) -> int:
    """The major number of a ``MAJOR.MINOR`` schema version."""
    try:
        return int(str(version).split(".", 1)[0])
    except ValueError:
        raise RecordError(f"schema version {version!r} is not MAJOR.MINOR") from None


def check_version(version: str, where: str) -> None:
    """Refuse data written with a newer major schema version than this library reads."""
    if major(version) > major(SCHEMA_VERSION):
        raise RecordError(
            f"{where} was written with schema version {version}, newer than this sparseety reads "
            f"({SCHEMA_VERSION}); upgrade sparseety to read it"
        )


def table_glob(root: Path, table: str) -> str:
    """The glob of ``table``'s committed files."""
    return str(root / table / "date=*" / "part-*.parquet")


def table_files(root: Path, table: str) -> list[Path]:
    """``table``'s committed files (temporary files excluded)."""
    return sorted((root / table).glob("date=*/part-*.parquet"))


def open_dataset(path: str | Path) -> Path:
    """The root of an existing dataset at ``path``; a clear :class:`RecordError` when there is none.

    Raises
    ------
    RecordError
        ``path`` does not exist, is not a trace dataset, or was written by a newer major schema.
    """
    root = Path(path)
    if not root.exists():
        raise RecordError(f"trace directory {root} does not exist")
    if not root.is_dir():
        raise RecordError(f"trace directory {root} is not a directory")
    if not (root / MARKER).is_file():
        raise RecordError(f"{root} is not a sparseety trace dataset (no {MARKER}; write one with `sparseety run`)")
    info = _marker(root)
    check_version(str(info["schema_version"]), f"trace dataset {root}")
    return root


def check_trace_dir(path: str | Path, *, what: str = "--trace-dir", min_free: int = MIN_FREE_BYTES) -> None:
    """Refuse, before any work, a trace directory a trace could not be written to.

    The shared output check (:func:`sparseety.output_paths.check_output`: a directory or one that can be created,
    writable for real, not in ``/proc``, no symbolic link loop, ``min_free`` bytes free) and, when it is a dataset
    already, one this version reads. Creates nothing. Raises :class:`InputError` (:class:`RecordError` for a
    newer dataset) naming ``what``, the path and the reason.
    """
    from sparseety.output_paths import DIRECTORY, check_output

    root = check_output(path, DIRECTORY, what, min_free=min_free)
    if (root / MARKER).is_file():
        open_dataset(root)


def uses_commit_log(root: Path) -> bool:
    """Whether readers of the dataset at ``root`` take only files a commit manifest names."""
    return _marker(root).get("commit_log") == COMMITS_DIR


def _marker(root: Path) -> dict[str, object]:
    marker = root / MARKER
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecordError(f"cannot read {marker}: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or "schema_version" not in info:
        raise RecordError(f"{marker} is not a sparseety dataset marker")
    return info


def create_dataset(path: str | Path) -> Path:
    """``path`` as a dataset root, creating it and its marker when missing (refuses a newer major).

    A dataset written before the commit log gets one: a manifest committing every file it holds, then
    ``commit_log`` in its marker.
    """
    root = Path(path)
    if (root / MARKER).is_file():
        open_dataset(root)
        if not uses_commit_log(root):
            write_manifest(root, [p for table in TABLES for p in table_files(root, table)])
            _write_marker(root, {**_marker(root), "commit_log": COMMITS_DIR})
        return root
    if root.exists() and not root.is_dir():
        raise RecordError(f"trace directory {root} is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    _write_marker(root, {"format": FORMAT, "schema_version": SCHEMA_VERSION, "tables": list(TABLES),
                         "commit_log": COMMITS_DIR})
    return root


def _write_marker(root: Path, marker: dict[str, object]) -> None:
    _atomic_bytes(root / MARKER, json.dumps(marker, indent=1).encode())


def write_part(root: Path, table: str, day: date, data: pa.Table, *, compression: str = "zstd") -> Path:
    """Write ``data`` as one new file of ``table``'s ``day`` partition, atomically; returns its path.

    The file is not committed (visible to readers) until a manifest names it.
    """
    folder = root / table / f"date={day.isoformat()}"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"part-{uuid.uuid4().hex}.parquet"
    final = folder / name
    tmp = folder / f".{name}.tmp"
    try:
        pq.write_table(data.combine_chunks().cast(file_schema(table)), tmp, compression=compression)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def _atomic_bytes(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)
