"""``sparseety analyze bias TRACE``: does a policy discriminate against numbers or the middle of the document?"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import app, user_errors

analyze_app = typer.Typer(help="Analyses of stored traces.", no_args_is_help=True)
app.add_typer(analyze_app, name="analyze")


@analyze_app.command("bias")
@user_errors
def bias_cmd(
    trace: Path = typer.Argument(..., help="A trace, or a trace directory (newest run unless --request-id)."),
    request_id: str | None = typer.Option(None, "--request-id", help="The run to analyse inside a trace directory."),
    as_json: bool = typer.Option(False, "--json", help="Print exactly one JSON object."),
) -> None:
    """Retained fraction by token class and by position bucket, against a uniform policy."""
    from sparseety.analysis.bias import bias_report
    from sparseety.store import load_trace

    report = bias_report(load_trace(trace, request_id))
    document = report.to_json()
    if as_json:
        sys.stdout.write(json.dumps(document) + "\n")
        return
    console = Console()
    console.print(f"request {report.request_id}: policy {report.policy} budget={report.budget}, "
                  f"{report.seen} positions, kept {report.slots_kept} of {report.slots_total} "
                  f"(layer, KV head, position) slots = {report.kept_fraction:.1%} (a uniform policy's rate)")
    for title, key in (("by token class", "by_class"), ("by position", "by_position")):
        table = Table("group", "positions", "kept slots", "retained", "lift vs uniform", title=title)
        for name, row in document[key].items():
            fraction = "-" if row["retained_fraction"] is None else f"{row['retained_fraction']:.1%}"
            lift = "-" if row["lift"] is None else f"{row['lift']:.2f}x"
            table.add_row(name, str(row["positions"]), f"{row['kept']} / {row['total']}", fraction, lift)
        console.print(table)
