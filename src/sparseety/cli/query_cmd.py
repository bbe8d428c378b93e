"""``sparseety query "SQL"``: DuckDB over the trace dataset's views, printed as a table, JSON or CSV.

The SQL runs in the store's sandbox (:mod:`sparseety.store.sandbox`): one read-only statement over the
dataset's views, no other file, URL, database or extension.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import typer

from sparseety.cli.app import app, user_errors
from sparseety.errors import InputError

TRACE_DIR_HELP = "Trace dataset directory (what `sparseety run --trace-dir` wrote)."
FORMATS = ("table", "json", "csv")


@app.command("query")
@user_errors
def query_command(
    sql: str = typer.Argument(..., help="SQL over the views requests, token_events, important_tokens, signals."),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    output_format: str = typer.Option("table", "--format", help="table|json|csv."),
) -> None:
    """Run SQL over a trace dataset (DuckDB; views requests, token_events, important_tokens, signals)."""
    import duckdb

    from sparseety.store import connect
    from sparseety.store.export import plain
    from sparseety.store.reader import VIEWS
    from sparseety.store.sandbox import check_sql

    if output_format not in FORMATS:
        raise InputError(f"--format must be one of {', '.join(FORMATS)}, got {output_format!r}")
    con = connect(trace_dir)
    try:
        check_sql(con, sql)
        relation = con.sql(sql)
        if relation is None:
            raise InputError("the SQL statement returns no rows; give a query (SELECT ...)")
        columns = list(relation.columns)
        rows = relation.fetchall()
    except duckdb.ParserException as exc:
        raise InputError(f"malformed SQL: {_first_line(exc)}") from None
    except duckdb.CatalogException as exc:
        raise InputError(f"{_first_line(exc)} (tables: {', '.join(VIEWS)})") from None
    except duckdb.PermissionException as exc:
        raise InputError(f"refused: query reads the trace dataset only ({_first_line(exc)})") from None
    except duckdb.Error as exc:
        raise InputError(f"query failed: {_first_line(exc)}") from None
    finally:
        con.close()
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
