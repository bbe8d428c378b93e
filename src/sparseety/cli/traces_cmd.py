"""``sparseety traces list`` / ``sparseety traces show ID``: a quick look at stored requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import app, user_errors
from sparseety.cli.query_cmd import SQL_MEMORY_OPT, SQL_THREADS_OPT, SQL_TIMEOUT_OPT, TRACE_DIR_HELP, sql_limits
from sparseety.errors import InputError

traces_app = typer.Typer(help="Look at stored requests.", no_args_is_help=True)
app.add_typer(traces_app, name="traces")

LIST_COLUMNS = ("request_id", "created_at", "model", "policy", "budget", "tier", "prompt_tokens",
                "completion_tokens", "eviction_events")


@traces_app.command("list")
@user_errors
def list_command(
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    limit: int = typer.Option(20, "--limit", help="Newest requests to list."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    sql_timeout: float | None = SQL_TIMEOUT_OPT,
    sql_memory_limit: str | None = SQL_MEMORY_OPT,
    sql_threads: int | None = SQL_THREADS_OPT,
) -> None:
    """The newest requests, newest first."""
    from sparseety.store import list_traces

    if limit <= 0:
        raise InputError(f"--limit must be positive, got {limit}")
    rows = list_traces(trace_dir, limit, limits=sql_limits(sql_timeout, sql_memory_limit, sql_threads))
    if as_json:
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        return
    table = Table(*LIST_COLUMNS, caption=f"{len(rows)} newest request(s) in {trace_dir}")
    table.columns[0].no_wrap = True
    for row in rows:
        table.add_row(*("-" if row[c] is None else str(row[c]) for c in LIST_COLUMNS))
    console = Console()
    needed = console.measure(table, options=console.options.update(max_width=100_000)).maximum
    # Never cut an id: wider than the terminal, the lines wrap there but every id stays whole.
    (Console(width=needed) if needed > console.width else console).print(table)


@traces_app.command("show")
@user_errors
def show_command(
    request_id: str = typer.Argument(..., help="Request id (see `sparseety traces list`)."),
    trace_dir: Path = typer.Option(Path("traces"), "--trace-dir", help=TRACE_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the stored document as one JSON object."),
    sql_timeout: float | None = SQL_TIMEOUT_OPT,
    sql_memory_limit: str | None = SQL_MEMORY_OPT,
    sql_threads: int | None = SQL_THREADS_OPT,
) -> None:
    """One request: what went in, what came out, what was evicted, which tokens mattered."""
    from sparseety.store import load_trace

    trace = load_trace(trace_dir, request_id, limits=sql_limits(sql_timeout, sql_memory_limit, sql_threads))
    doc = trace.document
    if as_json:
        payload = {**doc, "arrays": {name: list(array.shape) for name, array in trace.arrays.items()}}
        sys.stdout.write(json.dumps(payload, default=str) + "\n")
        return
    console = Console()
    sparsity, usage = doc.get("sparsity", {}), doc.get("usage", {})
    console.print(f"[bold]{trace.request_id}[/bold]  {doc.get('created_at')}  model {doc.get('model')}  tier {trace.tier}")
    console.print(f"policy {sparsity.get('policy')} budget {sparsity.get('budget')}  prompt {usage.get('prompt_tokens')} "
                  f"tokens, completion {usage.get('completion_tokens')}  evicted positions "
                  f"{sparsity.get('evicted_positions')} ({sparsity.get('eviction_events')} events)  "
                  f"drafts rejected {sparsity.get('draft_rejected')}")
    if doc.get("text") is not None:
        console.print("text: " + json.dumps(doc["text"], ensure_ascii=False), markup=False, highlight=False)
    records = doc.get("important_tokens") or []
    if records:
        table = Table("layer", "rank", "position", "token_id", "score", "text",
                      title="important tokens (first 10; rank 0 = most important)")
        for record in records[:10]:
            text = "" if record["text"] is None else json.dumps(record["text"], ensure_ascii=False)
            layer = "all" if record["layer"] is None else str(record["layer"])  # the all-layers ranking
            table.add_row(layer, str(record["rank"]), str(record["position"]),
                          str(record["token_id"]), f"{record['score']:.4f}", text)
        console.print(table)
    if trace.arrays:
        arrays = Table("array", "shape", "dtype", title="stored arrays")
        for name, array in sorted(trace.arrays.items()):
            arrays.add_row(name, "x".join(map(str, array.shape)), str(array.dtype))
        console.print(arrays)
