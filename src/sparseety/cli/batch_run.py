"""Running a ``--batch-file``: one continuous batch, one trace (and report) per request, a line per request out.

Exit code 2 when a line was refused or its request failed (each one an ``error: FILE line N: ...`` line),
else 1 when a trace could not be written (each one a ``warning:`` line; its answer is printed anyway), else 0.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.batch_file import prepare, read_batch_file
from sparseety.cli.run_inputs import RunInputs
from sparseety.cli.trace_output import TRACE_WRITE_FAILED, store_run
from sparseety.errors import InputError, SparseetyError

BAD_INPUT = 2


def run_batch_file(path: Path, inputs: RunInputs, *, model: str, trace_dir: Path, as_json: bool, no_report: bool,
                   redact: bool, ids_only: bool, sample_rate: float,
                   force_trace: bool, jsonl: Path | None, max_concurrency: int, prefill_chunk: int) -> None:
    """Run every valid line of ``path`` as one batch; each bad line or failed request is reported alone
    (``inputs``, checked, gives every line its default options)."""
    from sparseety.engine import SparseEngine
    from sparseety.models import load_model
    from sparseety.store import trace_tier
    from sparseety.store.dataset import check_trace_dir

    if max_concurrency <= 0 or prefill_chunk <= 0:
        raise InputError("--max-concurrency and --prefill-chunk must be positive")
    lines = read_batch_file(path)  # before the model loads, as is the trace directory
    traced = inputs.tier >= 1 or force_trace
    if traced:
        check_trace_dir(trace_dir)
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    items, errors = prepare(path, lines, inputs, tokenizer, lambda: uuid.uuid4().hex, engine.max_positions)
    batch = engine.batch(max_batch=max_concurrency, prefill_chunk=prefill_chunk)
    queued = []
    stored = _stored_ids(trace_dir) if traced else set()
    for item in items:
        if item.request_id in stored:  # one id, one trace: the server answers 409 for the same
            errors.append(f"{path} line {item.line}: request_id {item.request_id!r} is already in the trace store "
                          f"{trace_dir}: one id, one trace; give the line a new request_id (or none, and one is made)")
            continue
        tier = trace_tier(item.request_id, sample_rate, tier=inputs.tier, force=force_trace)
        try:
            batch.add(item.encoded, item.policy, item.options.replace(tier=tier), request_id=item.request_id)
        except SparseetyError as exc:  # InputError, or a ConfigError such as a learned policy without its file
            errors.append(f"{path} line {item.line}: {exc}")
            continue
        queued.append(item)
    for message in errors:
        _error(message)
    results = batch.run()
    table = Table("request", "policy", "prompt", "output", "evicted", "KV peak / dense", "text")
    done = warned = unwritten = 0
    for item in queued:
        result = results.get(item.request_id)
        if result is None:
            failure = batch.failures.get(item.request_id)
            errors.append(f"{path} line {item.line}: "
                          f"{failure.message() if failure else f'request {item.request_id} gave no result'}")
            _error(errors[-1])
            continue
        done += 1
        stored = store_run(result, trace_dir, redact=redact, ids_only=ids_only, sample_rate=sample_rate,
                           jsonl=jsonl, report=not no_report)
        warned += bool(stored.warnings)
        unwritten += stored.trace_error is not None
        if as_json:
            doc = result.to_json()
            if stored.trace_error is not None:
                doc["trace_error"] = stored.trace_error
            sys.stdout.write(json.dumps(doc) + "\n")
            sys.stdout.flush()
            continue
        dense = result.kv_cache_bytes_dense or 1
        report = "" if stored.report_path is None else f"  ({stored.report_path})"
        table.add_row(result.request_id, result.policy, str(len(result.prompt_ids)), str(len(result.output_ids)),
                      str(result.evicted_positions or 0), f"{result.kv_cache_bytes_peak / dense:.2f}",
                      result.text.replace("\n", " ")[:60] + report)
    if not as_json:
        console = Console()
        console.print(table)
        traces = "" if not traced else f"; traces in {trace_dir}" + (f" ({unwritten} not written)" if unwritten else "")
        console.print(f"{done} of {len(lines)} requests done in one batch (up to {max_concurrency} at once){traces}",
                      markup=False, highlight=False)
    if errors:
        raise typer.Exit(BAD_INPUT)
    if warned:
        raise typer.Exit(TRACE_WRITE_FAILED)


def _stored_ids(trace_dir: Path) -> set[str]:
    """The request ids the trace store at ``trace_dir`` holds (none when it is no dataset yet), read as the
    server reads them to answer 409 (:func:`sparseety.serve.request_ids.stored_request_ids`)."""
    from sparseety.serve.request_ids import stored_request_ids
    from sparseety.store.dataset import MARKER

    return stored_request_ids(trace_dir) if (trace_dir / MARKER).is_file() else set()


def _error(message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
