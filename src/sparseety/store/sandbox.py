"""The SQL sandbox: a DuckDB connection that reads the dataset's files and nothing else.

:func:`lock_down` runs after the views are created: it allows exactly the dataset's committed files,
switches external access off (no other file, URL, database or extension) and locks the configuration
so no statement can switch it back. :func:`check_sql` refuses, before running anything, every
statement but a query (``SELECT``, ``WITH``, ``DESCRIBE``, ``SUMMARIZE``, ``EXPLAIN``).
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from sparseety.errors import InputError

ALLOWED = frozenset({duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN})


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def lock_down(con: duckdb.DuckDBPyConnection, files: list[Path]) -> None:
    """Allow only ``files``, switch external access off and lock the configuration of ``con``."""
    allowed = "[" + ", ".join(_literal(str(p)) for p in files) + "]"
    con.execute(f"SET allowed_paths = {allowed}")
    con.execute("SET allowed_directories = []")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def check_sql(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Refuse ``sql`` unless it is exactly one read-only query.

    Raises
    ------
    InputError
        Malformed SQL, no statement, several statements, or one that writes, attaches, installs,
        loads, exports, sets or calls (named in the message).
    """
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise InputError(f"malformed SQL: {_first_line(exc)}") from None
    if not statements:
        raise InputError("no SQL statement given; give a query (SELECT ...)")
    if len(statements) > 1:
        raise InputError(f"give one SQL statement at a time, got {len(statements)} (run each separately)")
    statement = statements[0]
    if statement.type not in ALLOWED:
        words = statement.query.split()
        name = words[0].upper() if words else str(statement.type).rsplit(".", 1)[-1]
        raise InputError(f"{name} statements are not allowed: query reads the trace dataset only "
                         "(SELECT, WITH, DESCRIBE, SUMMARIZE, EXPLAIN)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
