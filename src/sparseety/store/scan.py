"""Which files of a trace dataset a reader may read, and which are damaged, orphaned or abandoned.

A data file is *committed* when a commit manifest names it (:mod:`sparseety.store.commits`; every file
of a dataset without a commit log). A committed file is *damaged* when its Parquet footer cannot be
read, it is not a sparseety file of its table, or (deep scan) its data cannot be decoded. A data file no
manifest names is *pending* while younger than the grace period (a writer is committing it) and
*orphaned* after (its writer died before the manifest); a temporary file past the grace period is
*abandoned*. A file written with a newer major schema version is refused, not skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from sparseety.errors import RecordError
from sparseety.store.commits import COMMITS_DIR, manifest_paths, read_manifest
from sparseety.store.dataset import TEMP_PREFIX, check_version, uses_commit_log
from sparseety.store.tables import TABLE_KEY, TABLES, VERSION_KEY

GRACE_S = 3600.0
"""How old an uncommitted or temporary file must be before it counts as left by a dead writer."""
_CACHE_LIMIT = 65536
_verdicts: dict[tuple[str, int, int, bool], str | None] = {}


@dataclass(frozen=True)
class Damaged:
    """A file readers skip, and why."""

    path: Path
    reason: str


@dataclass
class Scan:
    """One look at a dataset: readable committed files per table and everything else found."""

    root: Path
    files: dict[str, list[Path]] = field(default_factory=dict)
    damaged: list[Damaged] = field(default_factory=list)
    orphaned: list[Path] = field(default_factory=list)
    pending: list[Path] = field(default_factory=list)
    abandoned: list[Path] = field(default_factory=list)

    def all_files(self) -> list[Path]:
        """Every readable committed file."""
        return [path for files in self.files.values() for path in files]


def scan_dataset(root: Path, *, grace_s: float = GRACE_S, now: float | None = None, deep: bool = False) -> Scan:
    """Sort the files of the dataset at ``root`` (already opened); ``deep`` also decodes every file.

    Raises
    ------
    RecordError
        A committed file was written with a newer major schema version.
    """
    now = time.time() if now is None else now
    scan = Scan(root=root)
    committed = _committed(root, scan) if uses_commit_log(root) else None
    for table in TABLES:
        readable: list[Path] = []
        for path in sorted((root / table).glob("date=*/part-*.parquet")):
            rel = path.relative_to(root).as_posix()
            if committed is not None and rel not in committed:
                (scan.pending if _age(path, now) < grace_s else scan.orphaned).append(path)
                continue
            reason = file_problem(path, table, deep=deep)
            if reason is None:
                readable.append(path)
            else:
                scan.damaged.append(Damaged(path, reason))
        scan.files[table] = readable
        temps = sorted((root / table).glob(f"date=*/{TEMP_PREFIX}*.tmp"))
        scan.abandoned.extend(t for t in temps if _age(t, now) >= grace_s)
    scan.abandoned.extend(t for t in sorted((root / COMMITS_DIR).glob(".*.tmp")) if _age(t, now) >= grace_s)
    return scan


def _committed(root: Path, scan: Scan) -> set[str]:
    names: set[str] = set()
    for manifest in manifest_paths(root):
        try:
            names.update(read_manifest(manifest))
        except RecordError as exc:
            scan.damaged.append(Damaged(manifest, str(exc)))
    return names


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return 0.0


def file_problem(path: Path, table: str, *, deep: bool = False) -> str | None:
    """Why ``path`` cannot be read as a file of ``table`` (None: it can); cached per size and mtime.

    Raises
    ------
    RecordError
        The file was written with a newer major schema version.
    """
    try:
        stat = path.stat()
    except OSError as exc:
        return f"cannot stat: {exc.strerror or exc}"
    key = (str(path), stat.st_size, stat.st_mtime_ns, deep)
    if key in _verdicts:
        return _verdicts[key]
    verdict = _problem(path, table, deep)
    if len(_verdicts) >= _CACHE_LIMIT:
        _verdicts.clear()
    _verdicts[key] = verdict
    return verdict


def _problem(path: Path, table: str, deep: bool) -> str | None:
    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except Exception as exc:  # pyarrow raises several types for torn or foreign bytes
        return f"not a readable Parquet file ({_first_line(exc)})"
    kv = schema.metadata or {}
    if VERSION_KEY not in kv or kv.get(TABLE_KEY) != table.encode():
        return f"not a sparseety {table} file (no {VERSION_KEY.decode()}/{TABLE_KEY.decode()} metadata for it)"
    check_version(kv[VERSION_KEY].decode(errors="replace"), f"trace file {path}")
    expected = TABLES[table]
    for column in schema:
        want = expected.field(column.name).type if column.name in expected.names else None
        if want is not None and column.type != want:
            return f"column {column.name} is {column.type}, expected {want}"
    if "request_id" not in schema.names:
        return "no request_id column"
    if deep:
        try:
            pq.read_table(path)
            with duckdb.connect(":memory:") as con:  # the reader that queries it must decode it too
                con.sql("SELECT * FROM read_parquet(?)", params=[str(path)]).to_arrow_table()
        except Exception as exc:
            return f"data cannot be decoded ({_first_line(exc)})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
