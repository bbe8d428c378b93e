"""``sparseety audit-usage``: check a remote OpenAI-compatible server's token counts against the model's own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import app, user_errors
from sparseety.errors import InputError


@app.command("audit-usage")
@user_errors
def audit_usage(
    base_url: str = typer.Option(..., "--base-url", help="Server root, e.g. http://127.0.0.1:8000/v1."),
    model: str = typer.Option(..., "--model", help="Model name the server serves."),
    requests: Path = typer.Option(..., "--requests", help="JSONL: one chat ({messages}) or completion ({prompt}) body per line."),
    api_key: str | None = typer.Option(None, "--api-key", help="Bearer key (default: $SPARSEETY_API_KEY, else none)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="Local tokenizer: built-in name, directory or HF id (default: --model)."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait for each response before giving up."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Send each request and compare the server's usage with the local tokenizer and chat template."""
    import openai

    from sparseety.audit.usage import audit, read_requests
    from sparseety.models import load_tokenizer

    if timeout <= 0:
        raise InputError(f"--timeout must be positive, got {timeout}")
    bodies = read_requests(requests)
    local = load_tokenizer(tokenizer or model)
    key = api_key or os.environ.get("SPARSEETY_API_KEY") or "none"
    client = openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout, max_retries=0)
    checks = audit(client, model, bodies, local)
    disagreements = sum(not c.agrees for c in checks)
    if as_json:
        sys.stdout.write(json.dumps({"model": model, "tokenizer": tokenizer or model, "requests": len(checks),
                                     "disagreements": disagreements, "checks": [c.to_json() for c in checks]}) + "\n")
        return
    table = Table(title=f"usage audit: {base_url} ({model}) against tokenizer {tokenizer or model}")
    cached = any(c.server_cached is not None for c in checks)  # the server reports prefix-cache hits
    for column in ("line", "kind", "prompt server/local", "completion server/local", "verdict", "likely cause",
                   *(("cached prompt tokens",) if cached else ())):
        table.add_column(column)
    for c in checks:
        causes = "; ".join(x for x in (c.prompt_cause, c.completion_cause) if x) or ""
        extra = (f"{c.server_cached}: {c.cached_note}" if c.server_cached is not None else "",) if cached else ()
        table.add_row(str(c.line), c.kind, f"{c.server_prompt}/{c.local_prompt}",
                      f"{c.server_completion}/{c.local_completion}", "agree" if c.agrees else "DISAGREE", causes,
                      *extra)
    console = Console(width=160)
    console.print(table)
    console.print(f"{len(checks) - disagreements} of {len(checks)} requests agree; {disagreements} disagree")
