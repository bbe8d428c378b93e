"""``sparseety query "SQL"``: DuckDB over the trace dataset's views, printed as a table, JSON or CSV.

The SQL runs in the store's sandbox (:mod:`sparseety.store.sandbox`): one read-only statement over the
dataset's views, no other file, URL, database or extension, within the limits of ``--sql-timeout``,
``--sql-memory-limit`` and ``--sql-threads`` (shared with ``traces`` and ``report``).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from sparseety.cli.app import app, user_errors
from sparseety.errors import InputError

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection

    from sparseety.store.sandbox import SqlLimits, Watch

TRACE_DIR_HELP = "Trace dataset directory (what `sparseety run --trace-dir` wrote)."
FORMATS = ("table", "json", "csv")
# Defaults: sparseety.store.sandbox.CLI_LIMITS (not imported here: the CLI starts without DuckDB).
SQL_TIMEOUT_OPT = typer.Option(None, "--sql-timeout", help="Seconds the SQL may run before it is stopped "
                               "(default 30).")
SQL_MEMORY_OPT = typer.Option(None, "--sql-memory-limit", help="Memory DuckDB may use, e.g. 256MiB; no spilling "
                              "to disk (default 1GiB).")
SQL_THREADS_OPT = typer.Option(None, "--sql-threads", help="DuckDB threads (default 2).")


@app.command("query")
@user_errors
def query_command(
    sql: str = typer.Argument(..., help="SQL over the views requests, token_events, important_tokens, signals."),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    output_format: str = typer.Option("table", "--format", help="table|json|csv."),
    sql_timeout: float | None = SQL_TIMEOUT_OPT,
    sql_memory_limit: str | None = SQL_MEMORY_OPT,
    sql_threads: int | None = SQL_THREADS_OPT,
) -> None:
    """Run SQL over a trace dataset (DuckDB; views requests, token_events, important_tokens, signals)."""
    from sparseety.store import connect
    from sparseety.store.sandbox import watching

    limits = sql_limits(sql_timeout, sql_memory_limit, sql_threads)
    if output_format not in FORMATS:
        raise InputError(f"--format must be one of {', '.join(FORMATS)}, got {output_format!r}")
    with watching(limits) as watch:
        con = connect(trace_dir)
        try:
            columns, rows = _run(con, sql, watch)
        finally:
            con.close()
    _print(columns, rows, output_format)


def _run(con: DuckDBPyConnection, sql: str, watch: Watch) -> tuple[list[str], list[tuple[object, ...]]]:
    """Columns and rows of ``sql``; DuckDB's errors as :class:`InputError` (a limit's: named by ``watching``)."""
    import duckdb

    from sparseety.store.reader import VIEWS
    from sparseety.store.sandbox import check_sql, fetch_rows

    try:
        check_sql(con, sql)
        con.execute(sql)
        if con.description is None:
            raise InputError("the SQL statement returns no rows; give a query (SELECT ...)")
        return [d[0] for d in con.description], fetch_rows(con, watch)
    except duckdb.OutOfMemoryException:
        raise  # watching() names the memory limit
    except duckdb.InterruptException:
        watch.check()  # the statement timeout; else an interrupt from outside
        raise InputError("query interrupted") from None
    except duckdb.ParserException as exc:
        raise InputError(f"malformed SQL: {_first_line(exc)}") from None
    except duckdb.CatalogException as exc:
        raise InputError(f"{_first_line(exc)} (tables: {', '.join(VIEWS)})") from None
    except duckdb.PermissionException as exc:
        raise InputError(f"refused: query reads the trace dataset only ({_first_line(exc)})") from None
    except duckdb.Error as exc:
        raise InputError(f"query failed: {_first_line(exc)}") from None


def sql_limits(timeout: float | None, memory_limit: str | None, threads: int | None) -> SqlLimits:
    """The :class:`SqlLimits` of ``--sql-timeout``, ``--sql-memory-limit`` and ``--sql-threads`` (None: the default).

    Raises
    ------
    ConfigError
        A value out of range, naming its flag.
    """
    from sparseety.store.sandbox import CLI_LIMITS, MIN_MEMORY, SqlLimits, check_limits
    from sparseety.units import parse_size

    memory = CLI_LIMITS.memory_limit if memory_limit is None else parse_size(memory_limit, "--sql-memory-limit",
                                                                             minimum=MIN_MEMORY)
    threads = CLI_LIMITS.threads if threads is None else threads
    timeout = CLI_LIMITS.timeout if timeout is None else timeout
    check_limits(memory, threads, timeout, ("--sql-memory-limit", "--sql-threads", "--sql-timeout"), memory_limit)
    return SqlLimits(memory_limit=memory, threads=threads, timeout=float(timeout))


def _print(columns: list[str], rows: list[tuple[object, ...]], output_format: str) -> None:
    from sparseety.store.export import plain

    if output_format == "json":
        sys.stdout.write(json.dumps([dict(zip(columns, plain(list(row)))) for row in rows], ensure_ascii=False) + "\n")
    elif output_format == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_csv_cell(v) for v in plain(list(row))])
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(*columns, caption=f"{len(rows)} row{'s' if len(rows) != 1 else ''}")
        for row in rows:
            table.add_row(*(_table_cell(v) for v in plain(list(row))))
        Console().print(table)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _csv_cell(value: object) -> object:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (list, dict)) else ("" if value is None else value)


def _table_cell(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)
