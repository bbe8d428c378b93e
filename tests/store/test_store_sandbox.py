"""``sparseety query`` reads the dataset and nothing else: one test per escape route, each refused
with one ``error:`` line and exit code 2, and nothing read, written, attached or installed."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.store import connect, write_trace
from sparseety.store.synthetic import synthetic_result

SECRET = "top-secret-line"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dataset")
    write_trace(synthetic_result(0), root)
    return root


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("outside")
    (folder / "secret.csv").write_text(f"a\n{SECRET}\n")
    return folder


def query(root: Path, sql: str):
    return CliRunner().invoke(app, ["query", sql, "--trace-dir", str(root), "--format", "csv"])


def assert_refused(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and expected in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert SECRET not in result.stdout + result.stderr


READS = {
    "read_csv": "SELECT * FROM read_csv('{secret}')",
    "read_csv_auto": "SELECT * FROM read_csv_auto('{secret}')",
    "read_text": "SELECT content FROM read_text('{secret}')",
    "read_blob": "SELECT content FROM read_blob('{secret}')",
    "read_json": "SELECT * FROM read_json('{secret}')",
    "replacement_scan": "SELECT * FROM '{secret}'",
    "glob": "SELECT * FROM glob('{folder}/*')",
    "read_parquet_outside": "SELECT * FROM read_parquet('{folder}/*.parquet')",
    "url": "SELECT * FROM read_csv('https://example.com/x.csv')",
    "query_function": "SELECT * FROM query_table('{secret}')",
}


@pytest.mark.parametrize("route", sorted(READS))
def test_reading_another_file_is_refused(route: str, root: Path, outside: Path):
    sql = READS[route].format(secret=outside / "secret.csv", folder=outside)
    result = query(root, sql)
    assert result.exit_code == 2 and result.stderr.startswith("error: "), result.output
    assert SECRET not in result.stdout + result.stderr


def test_files_of_the_dataset_outside_its_commits_are_refused(root: Path):
    stray = root / "requests" / "stray.csv"
    stray.write_text(f"a\n{SECRET}\n")
    try:
        assert_refused(query(root, f"SELECT * FROM read_csv('{stray}')"), "refused")
    finally:
        stray.unlink()


STATEMENTS = {
    "copy_to": ("COPY (SELECT * FROM requests) TO '{out}/copy.csv'", "COPY statements are not allowed"),
    "attach": ("ATTACH '{out}/db.duckdb' AS other", "ATTACH statements are not allowed"),
    "install": ("INSTALL httpfs", "INSTALL statements are not allowed"),
    "load": ("LOAD httpfs", "LOAD statements are not allowed"),
    "export": ("EXPORT DATABASE '{out}/exported'", "EXPORT statements are not allowed"),
    "set_access": ("SET enable_external_access = true", "SET statements are not allowed"),
    "reset_lock": ("RESET lock_configuration", "RESET statements are not allowed"),
    "pragma": ("PRAGMA enable_profiling", "PRAGMA statements are not allowed"),
    "call": ("CALL pragma_version()", "CALL statements are not allowed"),
    "create": ("CREATE TABLE t AS SELECT 1", "CREATE statements are not allowed"),
    "insert": ("INSERT INTO requests SELECT * FROM requests", "INSERT statements are not allowed"),
    "drop": ("DROP VIEW requests", "DROP statements are not allowed"),
    "detach": ("DETACH memory", "DETACH statements are not allowed"),
    "use": ("USE memory", "USE statements are not allowed"),
    "several": ("SELECT 1; COPY (SELECT 1) TO '{out}/two.csv'", "one SQL statement at a time, got 2"),
}


@pytest.mark.parametrize("route", sorted(STATEMENTS))
def test_statements_that_write_attach_install_or_load_are_refused(route: str, root: Path, tmp_path: Path):
    sql, expected = STATEMENTS[route]
    assert_refused(query(root, sql.format(out=tmp_path)), expected)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_library_connection_is_locked_too(root: Path, tmp_path: Path, outside: Path):
    con = connect(root)
    assert con.sql("SELECT count(*) FROM requests").fetchall() == [(1,)]
    for sql in (f"COPY (SELECT 1) TO '{tmp_path}/x.csv'", f"SELECT * FROM read_csv('{outside}/secret.csv')",
                f"ATTACH '{tmp_path}/x.duckdb'"):
        with pytest.raises(duckdb.PermissionException):
            con.sql(sql)
    with pytest.raises(duckdb.Error, match="configuration"):
        con.execute("SET enable_external_access = true")
    assert list(tmp_path.iterdir()) == []


def test_queries_still_work(root: Path):
    for sql in ("SELECT count(*) AS n FROM token_events", "WITH a AS (SELECT * FROM requests) SELECT count(*) FROM a",
                "DESCRIBE requests", "SUMMARIZE important_tokens", "EXPLAIN SELECT * FROM signals",
                "FROM requests SELECT request_id"):
        result = query(root, sql)
        assert result.exit_code == 0, (sql, result.output)
