"""``sparseety export --format jsonl``: every row of a trace dataset as JSON lines."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from sparseety.cli.app import app, user_errors
from sparseety.cli.output_opts import FILE, check_outputs, output_file
from sparseety.cli.query_cmd import TRACE_DIR_HELP
from sparseety.errors import InputError


@app.command("export")
@user_errors
def export_command(
    output_format: str = typer.Option("jsonl", "--format", help="jsonl (the only format)."),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    out: Path | None = typer.Option(None, "-o", "--output", help="Write here instead of stdout (missing folders are "
                                    "created).", parser=output_file, metavar="FILE"),
    table: list[str] = typer.Option([], "--table", help="Only this table (repeatable) [default: all four]."),
    request_id: str | None = typer.Option(None, "--request-id", help="Only this request's rows."),
) -> None:
    """Export a trace dataset as JSON lines, one object per row with its "table"."""
    from sparseety.store.export import export_jsonl
    from sparseety.store.tables import TABLES

    if output_format != "jsonl":
        raise InputError(f"--format must be jsonl, got {output_format!r}")
    tables = table or list(TABLES)
    check_outputs("-o", out, FILE)  # before the dataset is read
    if out is None:
        export_jsonl(trace_dir, sys.stdout, tables=tables, request_id=request_id)
        return
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # as report -o and tune --out do
        with tmp.open("w", encoding="utf-8") as handle:
            counts = export_jsonl(trace_dir, handle, tables=tables, request_id=request_id)
        tmp.replace(out)
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {sum(counts.values())} rows to {out} ({', '.join(f'{k}: {v}' for k, v in counts.items())})",
          file=sys.stderr)
