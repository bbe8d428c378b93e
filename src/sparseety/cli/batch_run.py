"""Running a ``--batch-file``: one continuous batch, one trace (and report) per request, a line per request out."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sparseety.cli.batch_file import prepare
from sparseety.cli.run_inputs import RunInputs
from sparseety.errors import InputError


def run_batch_file(path: Path, inputs: RunInputs, *, model: str, max_new_tokens: int, trace_dir: Path, seed: int,
                   as_json: bool, no_report: bool, redact: bool, ids_only: bool, sample_rate: float,
                   force_trace: bool, jsonl: Path | None, max_concurrency: int, prefill_chunk: int) -> None:
    """Run every valid line of ``path`` as one batch; bad lines are reported and make the exit code 2."""
    from sparseety.engine import SparseEngine
    from sparseety.engine.request import GenerationOptions
    from sparseety.models import load_model
    from sparseety.store import load_trace, trace_tier, write_trace

    if max_concurrency <= 0 or prefill_chunk <= 0:
        raise InputError("--max-concurrency and --prefill-chunk must be positive")
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    items, errors = prepare(path, inputs, tokenizer, max_new_tokens, lambda: uuid.uuid4().hex)
    batch = engine.batch(max_batch=max_concurrency, prefill_chunk=prefill_chunk)
    queued = []
    for item in items:
        tier = trace_tier(item.request_id, sample_rate, tier=inputs.tier, force=force_trace)
        options = GenerationOptions(max_new_tokens=item.max_new_tokens, tier=tier, top_k=inputs.top_k, seed=seed,
                                    **inputs.engine_options(engine.num_layers))
        try:
            batch.add(item.encoded, item.policy, options, request_id=item.request_id)
        except InputError as exc:
            errors.append(f"{path} line {item.line}: {exc}")
            continue
        queued.append(item)
    for message in errors:
        print(f"error: {message}", file=sys.stderr, flush=True)
    results = batch.run()
    console = Console()
    table = Table("request", "policy", "prompt", "output", "evicted", "KV peak / dense", "text")
    for item in queued:
        result = results[item.request_id]
        report_path = None
        if result.tier >= 1:
            result.trace_path = str(write_trace(result, trace_dir, redact=redact, ids_only=ids_only,
                                                sample_rate=sample_rate))
            if jsonl is not None:
                from sparseety.cli.run_cmd import append_jsonl

                append_jsonl(trace_dir, result.request_id, jsonl)
            if not no_report:
                from sparseety.report import write_report

                report_path = write_report(load_trace(trace_dir, result.request_id))
        if as_json:
            sys.stdout.write(json.dumps(result.to_json()) + "\n")
            continue
        dense = result.kv_cache_bytes_dense or 1
        table.add_row(result.request_id, result.policy, str(len(result.prompt_ids)), str(len(result.output_ids)),
                      str(result.evicted_positions or 0), f"{result.kv_cache_bytes_peak / dense:.2f}",
                      result.text.replace("\n", " ")[:60] + ("" if report_path is None else f"  ({report_path})"))
    if not as_json:
        console.print(table)
        console.print(f"{len(queued)} requests in one batch (up to {max_concurrency} at once); traces in {trace_dir}",
                      markup=False, highlight=False)
    if errors:
        raise SystemExit(2)
