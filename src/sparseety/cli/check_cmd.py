"""``sparseety traces check [--repair]``: damaged, orphaned and abandoned files of a trace dataset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from sparseety.cli.app import user_errors
from sparseety.cli.query_cmd import TRACE_DIR_HELP
from sparseety.cli.traces_cmd import traces_app


@traces_app.command("check")
@user_errors
def check_command(
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    repair: bool = typer.Option(False, "--repair", help="Move every file found into <trace-dir>/_quarantine/."),
    grace: str = typer.Option("1h", "--grace", help="Age past which an uncommitted or temporary file counts as "
                              "left by a killed writer (younger ones may be a writer at work)."),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as one JSON object."),
) -> None:
    """Read every file of a trace dataset; list the damaged, orphaned and abandoned ones (exit 1 when any
    is left in place), and with --repair quarantine them."""
    from sparseety.store.health import check_dataset
    from sparseety.store.retention import parse_period

    result = check_dataset(trace_dir, repair=repair, grace_s=parse_period(grace).total_seconds())
    scan = result.scan
    findings = ([("damaged", d.path, d.reason) for d in scan.damaged]
                + [("orphaned", p, "data file no commit names: its writer died before committing") for p in scan.orphaned]
                + [("abandoned", p, "temporary file of a writer that died mid-write") for p in scan.abandoned])
    moved = dict(result.moved)
    if as_json:
        payload = {"trace_dir": str(trace_dir), "committed_files": len(scan.all_files()), "pending": len(scan.pending),
                   "findings": [{"kind": k, "path": str(p), "reason": r, "quarantined_to": str(moved[p]) if p in moved else None}
                                for k, p, r in findings]}
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        for kind, path, reason in findings:
            where = f" -> {moved[path]}" if path in moved else ""
            print(f"{kind:9s} {path}: {reason}{where}")
        summary = (f"{len(scan.all_files())} committed file(s) readable, {len(scan.damaged)} damaged, "
                   f"{len(scan.orphaned)} orphaned, {len(scan.abandoned)} abandoned, {len(scan.pending)} being written")
        if repair:
            summary += f"; quarantined {len(result.moved)} file(s)"
        elif findings:
            summary += "; `--repair` moves them into the quarantine folder"
        print(summary)
    if findings and not repair:
        raise typer.Exit(1)
