"""``sparseety bench faithfulness``: AOPC comprehensiveness and sufficiency of each importance ranking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import user_errors
from sparseety.cli.bench_cmd import bench_app
from sparseety.cli.output_opts import DIRECTORY, check_outputs, output_dir
from sparseety.cli.run_inputs import THREADS_OPT
from sparseety.models.registry import DEFAULT_MODEL


@bench_app.command("faithfulness")
@user_errors
def faithfulness_cmd(
    text: list[Path] = typer.Option([], "--text", help="Text file of one passage (repeatable; default: six licence "
                                    "texts under /usr/share/common-licenses)."),
    tokens: int = typer.Option(125, "--tokens", help="Passage length in tokens (the question comes after)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Built-in name, local directory or Hugging Face id."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Length of the dense greedy answer (the target)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random ranking."),
    out: Path = typer.Option(Path("bench-faithfulness"), "-o", "--out", parser=output_dir, metavar="DIR",
                             help="Folder for faithfulness.json and faithfulness.png."),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished run in --out without redoing its "
                                "finished prompts (faithfulness.json is rewritten after every prompt)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result document as JSON on stdout (no progress)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
    threads: int | None = THREADS_OPT,
    importance_weights: Path | None = typer.Option(
        None, "--importance-weights", help="Head weights (sparseety learn-importance) of the learned method "
        "(default: the weights shipped for --model, if any; else no learned method)."),
) -> None:
    """Delete each ranking's top 1/5/10/20% of prompt tokens: how much does log p(answer) drop?"""
    from sparseety.suites.faithfulness import (
        FRACTIONS,
        LEARNED,
        FaithfulnessCase,
        add_learned,
        report_document,
        run_faithfulness,
    )
    from sparseety.suites.faithfulness_prompts import default_texts, make_prompts, read_passage_text
    from sparseety.suites.resume import input_contents, write_document
    from sparseety.cli.bench_common import finished_results, saving_each, write_complete
    from sparseety.engine import SparseEngine
    from sparseety.errors import ConfigError, InputError
    from sparseety.extract.head_weights import read_head_weights, shipped_head_weights
    from sparseety.models import load_model
    from sparseety.output_paths import save_or_salvage
    from sparseety.threads import use_threads

    files = list(text) or default_texts()
    if not files:
        raise ConfigError("no passages: give --text FILE (no licence texts under /usr/share/common-licenses)")
    for file in files:  # not UTF-8, or empty: refused before the model loads
        read_passage_text(file)
    settings = {"model": model, "texts": [str(f) for f in files], "tokens": tokens, "max_new_tokens": max_new_tokens,
                "seed": seed, "inputs": input_contents(("--text", f) for f in files)}  # a changed passage is never reused
    if importance_weights is not None:
        read_head_weights(importance_weights)  # a damaged file is refused before the model loads
    check_outputs("-o", out, DIRECTORY, ("faithfulness.json", "faithfulness.png"))  # before the model loads
    target = out / "faithfulness.json"
    finished = finished_results(target, "faithfulness", settings, FaithfulnessCase, resume=resume)
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    use_threads(threads, quiet=quiet or as_json)
    head = engine.head_weights(importance_weights) if importance_weights is not None else \
        shipped_head_weights(engine.model_info.fingerprint())
    weights = None if head is None else head.identity()
    learned_before = [row for row in finished if LEARNED in row.comprehensiveness]
    if learned_before:
        before = (json.loads(target.read_text(encoding="utf-8")).get("importance_weights") or {}).get("digest")
        if weights is None or weights["digest"] != before:
            raise InputError(f"cannot resume from {target}: its finished cases ranked the learned method with other "
                             f"importance weights (digest {before}); give the same --importance-weights")
    prompts = make_prompts(files, lambda s: tokenizer(s, add_special_tokens=False)["input_ids"], tokens)
    if head is not None and len(learned_before) < len(finished):
        for row in finished:  # --resume of a run without the learned method: add it, redo nothing else
            if LEARNED not in row.comprehensiveness and row.case < len(prompts):
                add_learned(engine, row, prompts[row.case][1], head, max_new_tokens=max_new_tokens, seed=seed)
        write_document(target, {**report_document(model, FRACTIONS, finished, weights), "complete": False,
                                "run": settings})

    def describe(row: FaithfulnessCase) -> str:
        best = row.comprehensiveness
        extra = f", learned {sum(best[LEARNED]) / 4:.2f}" if LEARNED in best else ""
        return (f"{row.title} ({row.prompt_tokens} tokens): leave-one-out {sum(best['leave_one_out']) / 4:.2f}, "
                f"value {sum(best['value']) / 4:.2f}{extra} nats")

    with saving_each(target, settings, total=len(prompts), what="faithfulness cases", finished=finished,
                     describe=describe, quiet=quiet or as_json,
                     document=lambda rows: report_document(model, FRACTIONS, rows, weights)) as keep:
        cases = run_faithfulness(engine, prompts, max_new_tokens=max_new_tokens, seed=seed, finished=finished,
                                 on_result=keep, head_weights=head)
    document = write_complete(target, report_document(model, FRACTIONS, cases, weights), settings)
    figure = save_or_salvage(out / "faithfulness.png", lambda path: plot_faithfulness(document, path),
                             what="the figure", flag="-o")
    if as_json:
        print(json.dumps(document))
        return
    print_faithfulness(document, Console())
    Console().print(f"wrote {target} and {figure}")


def print_faithfulness(document: dict[str, Any], console: Console) -> None:
    """AOPC of both curves per method, and the share of leave-one-out's comprehensiveness."""
    table = Table("ranking", "AOPC comprehensiveness (nats)", "of leave-one-out", "AOPC sufficiency (nats)",
                  title="faithfulness (higher comprehensiveness, lower sufficiency is better)")
    for method, row in document["summary"].items():
        share = row["of_leave_one_out"]
        table.add_row(method, f"{row['aopc_comprehensiveness']:.2f}", "-" if share is None else f"{share:.2f}",
                      f"{row['aopc_sufficiency']:.2f}")
    console.print(table)


def plot_faithfulness(document: dict[str, Any], path: Path) -> Path:
    """Comprehensiveness and sufficiency against the fraction deleted (kept), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = [100 * f for f in document["fractions"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method, row in document["summary"].items():
        axes[0].plot(fractions, row["comprehensiveness"], marker="o", label=method)
        axes[1].plot(fractions, row["sufficiency"], marker="o", label=method)
    axes[0].set(title="comprehensiveness: top k% deleted", xlabel="% of prompt tokens", ylabel="drop of log p(answer)")
    axes[1].set(title="sufficiency: only top k% kept", xlabel="% of prompt tokens", ylabel="drop of log p(answer)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
