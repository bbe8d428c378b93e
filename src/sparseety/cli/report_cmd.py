"""``sparseety report``: one self-contained HTML file (and optionally PNG figures) from a trace or a bench/tune result."""

from __future__ import annotations

from pathlib import Path

import typer

from sparseety.cli.app import app, user_errors
from sparseety.cli.output_opts import DIRECTORY, FILE, check_outputs, output_dir, output_file
from sparseety.cli.query_cmd import SQL_MEMORY_OPT, SQL_THREADS_OPT, SQL_TIMEOUT_OPT, sql_limits


@app.command("report")
@user_errors
def report(
    trace: Path = typer.Argument(..., metavar="TRACE", help="Trace path, trace directory, or a `bench passkey` / `tune` JSON file."),
    out: Path | None = typer.Option(None, "-o", "--out", help="HTML file to write (default: <trace dir>/reports/<id>.html).",
                                    parser=output_file, metavar="FILE"),
    png: Path | None = typer.Option(None, "--png", help="Also write the figures as PNG files into this directory.",
                                    parser=output_dir, metavar="DIR"),
    layer: int | None = typer.Option(None, "--layer", help="Layer selected when the report opens (default: all layers)."),
    request_id: str | None = typer.Option(None, "--request-id", help="Which request of a trace directory (default: newest)."),
    sql_timeout: float | None = SQL_TIMEOUT_OPT,
    sql_memory_limit: str | None = SQL_MEMORY_OPT,
    sql_threads: int | None = SQL_THREADS_OPT,
) -> None:
    """Write one self-contained HTML report (opens offline, no network): summary, text shaded by importance
    with token details on hover, eviction timeline per layer, kept fraction per layer, top tokens, and the
    compare / MoE / draft / pruning / passkey / tune sections the source has."""
    from sparseety.report.html import render_view
    from sparseety.report.plots import save_figures
    from sparseety.report.write import default_report_path, report_view, write_html
    from sparseety.store.sandbox import using

    check_outputs("-o", out, FILE)  # before the trace is read
    check_outputs("--png", png, DIRECTORY)
    with using(sql_limits(sql_timeout, sql_memory_limit, sql_threads)):  # reading the trace
        view, stored, json_source = report_view(trace, layer=layer, request_id=request_id)
    target = out if out is not None else default_report_path(stored, json_source)
    write_html(target, render_view(view))
    print(f"report: {target}")
    if png is not None:
        for path in save_figures(view, png):
            print(f"figure: {path}")
