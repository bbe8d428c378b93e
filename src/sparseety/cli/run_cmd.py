"""``sparseety run``: the main job, a traced sparse generation."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress

from sparseety.cli import run_inputs as opt
from sparseety.cli.app import app, user_errors
from sparseety.cli.generation_flags import generation_flags
from sparseety.cli.output_opts import FILE, check_outputs, output_file
from sparseety.cli.progress import Steps, steps
from sparseety.cli.run_inputs import RunInputs, read_text
from sparseety.errors import InputError
from sparseety.run_file import with_run_file
from sparseety.threads import use_threads

__all__ = ["read_text", "run"]


@app.command("run")
@user_errors
@with_run_file
@generation_flags
def run(
    ctx: typer.Context,
    inputs: RunInputs,
    model: str,
    trace_dir: Path,
    as_json: bool,
    config: Path | None = opt.CONFIG_OPT,
    no_report: bool = typer.Option(False, "--no-report", help="Do not write the HTML report next to the trace."),
    redact: bool = typer.Option(False, "--redact", help="Replace emails, phones, IPs, cards and API keys in stored text."),
    ids_only: bool = typer.Option(False, "--ids-only", help="Store token ids and no text at all."),
    sample_rate: float = typer.Option(
        1.0, "--sample-rate", help="Fraction of request ids traced at --tier (by a stable hash); the rest at tier 1."),
    force_trace: bool = typer.Option(False, "--force-trace", help="Trace this request at tier 3 whatever the sample."),
    jsonl: Path | None = typer.Option(None, "--jsonl", help="Also append this run's stored rows to FILE as JSONL.",
                                      parser=output_file, metavar="FILE"),
    batch_file: Path | None = typer.Option(
        None, "--batch-file", help="JSONL of requests (prompt or messages; optional policy, budget, ratio, "
        "max_new_tokens, request_id) run as one continuous batch; one trace each."),
    max_concurrency: int = typer.Option(8, "--max-concurrency", help="With --batch-file: sequences decoded together."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", help="With --batch-file: prompt tokens prefilled per step."),
    threads: int | None = opt.THREADS_OPT,
) -> None:
    """Generate with a sparse KV policy and trace which tokens went in, came out and were evicted."""
    # Heavy imports (torch, transformers) stay out of CLI start-up for the other commands.
    import uuid

    from sparseety.cli.summary import print_summary
    from sparseety.cli.trace_output import TRACE_WRITE_FAILED, store_run
    from sparseety.engine import SparseEngine
    from sparseety.models import load_model
    from sparseety.store import trace_tier
    from sparseety.store.dataset import check_trace_dir

    check_outputs("--jsonl", None if jsonl is None else Path(jsonl), FILE)  # before the model loads
    if batch_file is not None:
        from sparseety.cli.batch_run import run_batch_file

        inputs.check(need_source=False)
        if any(x is not None for x in (inputs.prompt, inputs.prompt_file, inputs.context_file)):
            raise InputError("--batch-file holds the prompts: leave out --prompt, --prompt-file and --context-file")
        if inputs.speculative is not None:
            raise InputError("--speculative cannot be combined with --batch-file: speculative decoding runs one "
                             "sequence at a time")
        use_threads(threads, quiet=as_json)
        run_batch_file(batch_file, inputs, model=model, trace_dir=trace_dir, as_json=as_json, no_report=no_report,
                       redact=redact, ids_only=ids_only,
                       sample_rate=sample_rate, force_trace=force_trace, jsonl=jsonl,
                       max_concurrency=max_concurrency, prefill_chunk=prefill_chunk)
        return
    inputs.check()
    request_id = uuid.uuid4().hex  # decided first: the sample and the forced tier depend on it
    tier = trace_tier(request_id, sample_rate, tier=inputs.tier, force=force_trace)
    if tier >= 1:
        check_trace_dir(trace_dir)  # before the model loads: a trace that cannot be written fails at once
    sources = inputs.read_sources()

    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    encoded = inputs.encode(tokenizer, sources, max_positions=engine.max_positions)
    kv_policy = inputs.policy_for(encoded)
    use_threads(threads, quiet=as_json)

    stderr = Console(stderr=True)
    with Progress(console=stderr, transient=True, disable=as_json or encoded.input_len < 512) as progress, \
            steps(-(-inputs.max_new_tokens // DECODE_STEP), f"decode (steps of {DECODE_STEP} tokens)",
                  quiet=as_json or inputs.max_new_tokens < 2 * DECODE_STEP) as decode:
        task = progress.add_task(f"prefill {encoded.input_len} tokens", total=engine.num_layers)
        result = engine.generate(
            encoded, kv_policy, inputs.generation_options(tier=tier), request_id=request_id,
            on_prefill_layer=lambda layer, n: progress.update(task, completed=layer + 1),
            streamer=DecodeProgress(decode),
        )
    stored = store_run(result, trace_dir, redact=redact, ids_only=ids_only, sample_rate=sample_rate,
                       jsonl=None if jsonl is None else Path(jsonl), report=not no_report)
    report_path = stored.report_path
    if as_json:
        doc = result.to_json()
        if stored.trace_error is not None:
            doc["trace_error"] = stored.trace_error
        sys.stdout.write(json.dumps(doc) + "\n")
        if report_path is not None:
            stderr.print(f"report: {report_path}", markup=False, highlight=False, soft_wrap=True)
    else:
        console = Console()
        console.print(result.text, markup=False, highlight=False)
        print_summary(result, console)
        if report_path is not None:
            console.print(f"report: {report_path}", markup=False, highlight=False, soft_wrap=True)
    if stored.warnings:
        raise typer.Exit(TRACE_WRITE_FAILED)


DECODE_STEP = 16  #: generated tokens per progress step of a long decode


class DecodeProgress:
    """A ``model.generate`` streamer that reports every :data:`DECODE_STEP` generated tokens."""

    def __init__(self, decode: Steps) -> None:
        self.decode, self.tokens, self.prompt_seen = decode, 0, False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # the prompt comes first
            self.prompt_seen = True
            return
        before = self.tokens // DECODE_STEP
        self.tokens += int(value.numel())
        for _ in range(self.tokens // DECODE_STEP - before):
            self.decode.advance(f"{self.tokens} tokens")

    def end(self) -> None:
        if self.tokens % DECODE_STEP:
            self.decode.advance(f"{self.tokens} tokens, done")
