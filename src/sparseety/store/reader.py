"""Reading a trace dataset: DuckDB views over its tables, one request back as a :class:`StoredTrace`,
and request summaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sparseety.errors import RecordError
from sparseety.schema import TokenRecord
from sparseety.store.commits import manifest_paths, read_manifest
from sparseety.store.dataset import open_dataset, uses_commit_log
from sparseety.store.notices import notice
from sparseety.store.rows import DRAFT_COLUMNS, DRAFT_EVENTS, DRAFT_GROUP, EVENT_COLUMNS, EVENT_REASONS
from sparseety.store.sandbox import LIMIT_ERRORS, SqlLimits, apply_limits, bounded, lock_down
from sparseety.store.scan import Scan, file_problem, scan_dataset
from sparseety.store.tables import TABLES

VIEWS = tuple(TABLES)


@dataclass
class StoredTrace:
    """One stored request.

    Attributes
    ----------
    document : the ``sparseety run --json`` object plus ``prompt_token_ids``, ``token_texts``,
        ``provenance`` and any ``extra`` sections.
    arrays : the run's arrays (:attr:`RunResult.arrays` names and dtypes).
    path : the ``requests`` file holding the request.
    """

    document: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: Path

    @property
    def request_id(self) -> str:
        return str(self.document["request_id"])

    @property
    def tier(self) -> int:
        return int(self.document["tier"])


def connect(trace_dir: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory, sandboxed DuckDB connection with views ``requests``, ``token_events``,
    ``important_tokens``, ``signals`` over the dataset's committed files (with the Hive ``date``
    column); a table without files yet is an empty view.

    Damaged files are skipped, each named in one notice (:mod:`sparseety.store.notices`). The
    connection reads those files and nothing else (:mod:`sparseety.store.sandbox`).

    Raises
    ------
    RecordError
        Not a dataset, or a file written with a newer major schema version.
    """
    return _connect(_scan(trace_dir))


def _scan(trace_dir: str | Path) -> Scan:
    scan = scan_dataset(open_dataset(trace_dir))
    for damaged in scan.damaged:
        notice(f"skipped damaged file {damaged.path}: {damaged.reason} "
               f"(`sparseety traces check --repair` quarantines it)")
    return scan


def _connect(scan: Scan) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    apply_limits(con)
    for table in VIEWS:
        files = scan.files[table]
        if files:
            try:
                _create_view(con, table, files)
            except LIMIT_ERRORS:  # a limit stopped it, not a damaged file
                raise
            except duckdb.Error:  # a file whose footer pyarrow read but DuckDB refuses: find and skip it
                files = scan.files[table] = _readable_by_duckdb(con, files)
        if files:
            try:
                _create_view(con, table, files)
            except duckdb.Error as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise RecordError(f"cannot read table {table} of {scan.root}: {first} "
                                  "(run `sparseety traces check`)") from None
        else:
            empty = TABLES[table].empty_table().append_column("date", pa.array([], pa.date32()))
            con.register(f"_empty_{table}", empty)
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM _empty_{table}")
    lock_down(con, scan.all_files())
    return con


def _create_view(con: duckdb.DuckDBPyConnection, table: str, files: list[Path]) -> None:
    listed = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in files) + "]"
    con.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM read_parquet({listed}, hive_partitioning = true, "
                f"union_by_name = true)")
    con.execute(f"SELECT * FROM {table} LIMIT 0").fetchall()


def _readable_by_duckdb(con: duckdb.DuckDBPyConnection, files: list[Path]) -> list[Path]:
    readable = []
    for path in files:
        try:
            con.execute("SELECT * FROM read_parquet(?) LIMIT 0", [str(path)]).fetchall()
        except LIMIT_ERRORS:
            raise
        except duckdb.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            notice(f"skipped damaged file {path}: DuckDB cannot read it ({first}) "
                   f"(`sparseety traces check --repair` quarantines it)")
            continue
        readable.append(path)
    return readable


@bounded
def load_trace(path: str | Path, request_id: str | None = None, limits: SqlLimits | None = None) -> StoredTrace:
    """Read one request back.

    Parameters
    ----------
    path : the dataset root, or a ``requests`` file inside it (what ``write_trace`` returned).
    request_id : the request to read; None: the one in the ``requests`` file, or the newest.
    limits : SQL bounds of the read (default: :func:`~sparseety.store.sandbox.current_limits`).

    A request id stored more than once (two writers, or a request submitted twice) reads as its newest
    copy, with a notice: its arrays and important tokens come from that copy's commit, or are left out
    when the copies cannot be told apart (written in one commit, or a dataset without a commit log).

    Raises
    ------
    RecordError
        Missing or not a dataset, newer major schema, or no such request.
    QueryLimitError
        The read passed a limit of ``limits``.
    """
    given = Path(path)
    root, file = _root_of(given)
    scan = _scan(root)
    con = _connect(scan)
    if request_id is None and file is not None:
        problem = file_problem(file, "requests")
        if problem is not None:
            raise RecordError(f"{file} is damaged: {problem}")
        ids = pq.read_table(file, columns=["request_id", "created_at"]).to_pylist()
        if not ids:
            raise RecordError(f"{file} holds no request")
        request_id = max(ids, key=lambda r: r["created_at"])["request_id"]
    if request_id is None:
        newest = _arrow(con, "SELECT request_id FROM requests ORDER BY created_at DESC, request_id LIMIT 1", [])
        if newest.num_rows == 0:
            raise RecordError(f"trace dataset {root} holds no request yet")
        request_id = newest.column("request_id")[0].as_py()
    found = _arrow(
        con,
        "SELECT *, filename AS _file, count(*) OVER () AS _copies FROM read_parquet(?, hive_partitioning = true, "
        "union_by_name = true, filename = true) WHERE request_id = ? ORDER BY created_at DESC LIMIT 1",
        [[str(p) for p in scan.files["requests"]], request_id],
    ) if scan.files["requests"] else None
    if found is None or found.num_rows == 0:
        raise RecordError(f"no request with id {request_id!r} in {root}")
    request = found.to_pylist()[0]
    document = _document(request)
    manifest = document.pop("arrays", {}) or {}
    source: duckdb.DuckDBPyConnection | None = con
    if request["_copies"] > 1:
        source = _newest_copy(scan, Path(request["_file"]), request_id, request["_copies"], document["created_at"])
    arrays: dict[str, np.ndarray] = {}
    document["important_tokens"] = []
    if source is not None:
        arrays = {**_event_arrays(source, request_id, manifest), **_signal_arrays(source, request_id, manifest)}
        document["important_tokens"] = _records(source, request_id)
    document["trace_path"] = str(request["_file"])
    return StoredTrace(document=document, arrays=arrays, path=Path(request["_file"]))


def _newest_copy(scan: Scan, file: Path, request_id: str, copies: int,
                 created: str) -> duckdb.DuckDBPyConnection | None:
    """A connection over the files of the commit holding the newest of ``copies`` rows of ``request_id``
    (in ``file``); None, with a notice, when that commit cannot tell the copies apart."""
    said = f"request {request_id!r} is stored {copies} times in {scan.root}: showing the newest copy ({created})"
    rel = file.relative_to(scan.root).as_posix()
    names = next((set(n) for n in map(_manifest_files, manifest_paths(scan.root)) if rel in n), None) \
        if uses_commit_log(scan.root) else None
    if names is not None:
        files = {table: [p for p in scan.files[table] if p.relative_to(scan.root).as_posix() in names]
                 for table in VIEWS}
        in_commit = sum(pq.read_table(p, columns=["request_id"], filters=[("request_id", "=", request_id)]).num_rows
                        for p in files["requests"])
        if in_commit == 1:
            notice(said)
            return _connect(Scan(root=scan.root, files=files))
    notice(f"{said}, without its arrays and important tokens (its copies were written together and cannot be "
           "told apart)")
    return None


def _manifest_files(path: Path) -> list[str]:
    try:
        return read_manifest(path)
    except RecordError:  # a damaged manifest: the scan has reported it
        return []


def _root_of(path: Path) -> tuple[Path, Path | None]:
    """The dataset root and, when ``path`` is a ``requests`` file, that file."""
    if path.is_file() and path.suffix == ".parquet":
        root = path.parent.parent.parent
        if path.parent.parent.name != "requests":
            raise RecordError(f"{path} is not a requests file of a trace dataset")
        return root, path
    return path, None


def _document(request: dict[str, Any]) -> dict[str, Any]:
    document = json.loads(request["document_json"])
    document["request_id"] = request["request_id"]
    document["text"] = request["text"]
    prompt = request["prompt_token_ids"]
    document["prompt_token_ids"] = list(prompt) if prompt is not None else []
    output = request["output_token_ids"]
    document["output_token_ids"] = list(output) if output is not None else []
    document["token_texts"] = list(request["token_texts"] or [])
    document["created_at"] = request["created_at"].isoformat()
    document["sample_rate"] = request["sample_rate"]
    document["redacted"] = request["redacted"]
    document["ids_only"] = request["ids_only"]
    if request["extra_json"]:
        document.update(json.loads(request["extra_json"]))
    return document


def _event_arrays(con: duckdb.DuckDBPyConnection, request_id: str, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    groups = sorted({e["group"] for e in manifest.values() if e["table"] == "token_events"})
    if not groups:
        return {}
    events = [EVENT_REASONS.get(g, (g, None))[0] for g in groups if g != DRAFT_GROUP]
    events += list(DRAFT_EVENTS) if DRAFT_GROUP in groups else []
    has_reason = "reason" in [d[0] for d in con.execute("SELECT * FROM token_events LIMIT 0").description]
    table = _arrow(
        con,
        f"SELECT event, {'reason' if has_reason else 'NULL::VARCHAR AS reason'}, seq, step, layer, kv_head, position, "
        "token_id, score FROM token_events WHERE request_id = ? AND list_contains(?, event) ORDER BY event, seq",
        [request_id, events],
    )
    event = np.asarray(table.column("event").to_pylist(), dtype=object)
    reason = np.asarray(table.column("reason").to_pylist(), dtype=object)
    columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    out: dict[str, np.ndarray] = {}
    for group in groups:
        if group == DRAFT_GROUP:
            rows = np.isin(event, DRAFT_EVENTS)
            order = np.argsort(columns["seq"][rows], kind="stable")
            picked = {c: columns[c][rows][order] for c in ("step", "position", "token_id")}
            picked["rejected"] = (event[rows][order] == DRAFT_EVENTS[1]).astype(np.int64)
            names = DRAFT_COLUMNS
        else:
            name, why = EVENT_REASONS.get(group, (group, None))
            rows = event == name
            if why == "window":
                rows &= reason == "window"
            elif why is not None:  # older files have no reason: only the window edges carry one there
                rows &= reason != "window"
            picked = {c: columns[c][rows] for c in EVENT_COLUMNS}
            names = EVENT_COLUMNS
        for column in names:
            name = f"{group}.{column}"
            entry = manifest[name]
            out[name] = np.asarray(picked[column]).astype(np.dtype(entry["dtype"])).reshape(entry["shape"])
    return out


def _signal_arrays(con: duckdb.DuckDBPyConnection, request_id: str, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    names = [name for name, e in manifest.items() if e["table"] == "signals"]
    if not names:
        return {}
    table = _arrow(
        con,
        "SELECT name, row, values, int_values FROM signals WHERE request_id = ? ORDER BY name, row",
        [request_id],
    )
    out: dict[str, np.ndarray] = {}
    all_names = np.asarray(table.column("name").to_pylist(), dtype=object)
    for name in names:
        entry = manifest[name]
        dtype, shape = np.dtype(entry["dtype"]), entry["shape"]
        rows = np.flatnonzero(all_names == name)
        column = "int_values" if dtype.kind in "biu" else "values"
        if len(rows):
            lists = table.column(column).take(pa.array(rows)).combine_chunks()
            flat = lists.flatten().to_numpy(zero_copy_only=False)
        else:
            flat = np.zeros(0)
        if flat.size != int(np.prod(shape)):
            raise RecordError(f"stored signal {name!r} of request {request_id} has {flat.size} values, "
                              f"expected shape {shape}")
        out[name] = flat.astype(dtype).reshape(shape)
    return out


def _records(con: duckdb.DuckDBPyConnection, request_id: str) -> list[dict[str, Any]]:
    rows = _arrow(
        con,
        "SELECT token_id, position, score, layer, step, head, rank, token_type, text, experts "
        "FROM important_tokens WHERE request_id = ? ORDER BY seq",
        [request_id],
    ).to_pylist()
    records = []
    for row in rows:
        experts = row.pop("experts")
        row["experts"] = None if experts is None else [[e["expert_id"], e["prob"]] for e in experts]
        records.append(TokenRecord.from_dict(row).to_dict())
    return records


def _arrow(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> pa.Table:
    """Run ``sql`` with ``params`` and return the result as an Arrow table.

    Raises
    ------
    RecordError
        DuckDB could not read a file (damaged past its footer).
    """
    try:
        return con.sql(sql, params=params).to_arrow_table()
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecordError(f"reading the trace dataset failed: {first} (run `sparseety traces check`)") from None


@bounded
def list_traces(trace_dir: str | Path, limit: int = 20, limits: SqlLimits | None = None) -> list[dict[str, Any]]:
    """Summaries of the newest ``limit`` requests, newest first (a request stored more than once: its newest
    copy, with a notice), read within ``limits`` (default: the current ones; else :class:`QueryLimitError`)."""
    if limit <= 0:
        raise RecordError(f"limit must be positive, got {limit}")
    con = connect(trace_dir)
    table = _arrow(  # a request stored more than once is listed once: its newest copy
        con,
        "SELECT request_id, created_at, model, policy, budget, tier, prompt_tokens, completion_tokens, "
        "evicted_positions, eviction_events, draft_rejected, kv_cache_bytes_peak, prefill_s, decode_s, "
        "count(*) OVER (PARTITION BY request_id) AS _copies FROM requests "
        "QUALIFY row_number() OVER (PARTITION BY request_id ORDER BY created_at DESC) = 1 "
        "ORDER BY created_at DESC, request_id LIMIT ?",
        [limit],
    )
    rows = table.to_pylist()
    for row in rows:
        row["created_at"] = row["created_at"].isoformat()
        copies = row.pop("_copies")
        if copies > 1:
            notice(f"request {row['request_id']!r} is stored {copies} times in {trace_dir}: listing the "
                   f"newest copy ({row['created_at']})")
    return rows
