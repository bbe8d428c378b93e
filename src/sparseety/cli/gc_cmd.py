"""``sparseety gc --older-than 7d``: delete trace partitions past a retention period."""

from __future__ import annotations

from pathlib import Path

import typer

from sparseety.cli.app import app, user_errors
from sparseety.cli.query_cmd import TRACE_DIR_HELP


@app.command("gc")
@user_errors
def gc_command(
    older_than: str = typer.Option(..., "--older-than", help="Retention period: 7d, 12h, 30m, 2w, 90s."),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted, delete nothing."),
    grace: str = typer.Option("1h", "--grace", help="Age past which a temporary or never-committed file "
                              "counts as left by a killed writer."),
) -> None:
    """Delete date partitions whose whole day is older than the retention period, and killed writers' leftovers."""
    from sparseety.store.retention import collect_garbage, parse_period

    period = parse_period(older_than)
    result = collect_garbage(trace_dir, period, dry_run=dry_run, grace=parse_period(grace))
    verb = "would delete" if dry_run else "deleted"
    for folder in result.partitions:
        print(f"{verb} {folder}")
    for temp in result.stale_temp_files:
        print(f"{verb} stale temporary file {temp}")
    for orphan in result.orphaned_files:
        print(f"{verb} never-committed file {orphan}")
    print(f"{verb} {len(result.partitions)} partition(s), {result.files} file(s) older than "
          f"{result.cutoff.isoformat(timespec='seconds')}")
