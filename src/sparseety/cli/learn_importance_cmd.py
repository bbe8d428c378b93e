"""``sparseety learn-importance``: fit ``--importance learned``'s per-(layer, head) weights on training text."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from sparseety.cli.app import app, user_errors
from sparseety.cli.output_opts import FILE, check_outputs, output_file
from sparseety.cli.run_inputs import THREADS_OPT
from sparseety.models.registry import DEFAULT_MODEL


@app.command("learn-importance")
@user_errors
def learn_importance_cmd(
    texts: list[Path] = typer.Argument(..., help="Training text files, one passage from each (never the texts "
                                       "you evaluate on)."),
    out: Path = typer.Option(..., "-o", "--out", help="Weights file to write (JSON).", parser=output_file,
                             metavar="FILE"),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Built-in name, local directory or Hugging Face id."),
    feature: str = typer.Option("output", "--feature", help="Per-head score the weights multiply: attention, "
                                "value or output."),
    tokens: int = typer.Option(125, "--tokens", help="Passage length in tokens (a question comes after)."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Length of the dense greedy answer (the target)."),
    ablations: int = typer.Option(32, "--ablations", help="Random deletions of 1-20% of a prompt's positions, "
                                  "besides leave-one-out."),
    steps: int = typer.Option(400, "--steps", help="Optimizer steps of the fit."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random deletions."),
    as_json: bool = typer.Option(False, "--json", help="Print the weights file's provenance as JSON (no progress)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
    threads: int | None = THREADS_OPT,
) -> None:
    """Measure how much deleting prompt tokens hurts each training answer, and fit one non-negative weight per
    (layer, head) so that the weighted attention scores predict it (AT2, arXiv 2504.13752)."""
    from sparseety.suites.faithfulness_prompts import make_prompts, read_passage_text
    from sparseety.cli.progress import steps as progress_steps
    from sparseety.engine import SparseEngine
    from sparseety.errors import ConfigError
    from sparseety.training.head_weights import learn_head_weights
    from sparseety.extract.scoring import FEATURES
    from sparseety.models import load_model
    from sparseety.output_paths import save_or_salvage
    from sparseety.threads import use_threads

    if feature not in FEATURES:
        raise ConfigError(f"--feature must be one of {', '.join(FEATURES)}, got {feature!r}")
    missing = [str(t) for t in texts if not t.is_file()]
    if missing:
        raise ConfigError(f"training text {missing[0]} is not a file")
    for text in texts:  # not UTF-8, or empty: refused before the model loads, never trained on
        read_passage_text(text, "training text")
    check_outputs("-o", out, FILE)  # before the model loads: the fit is never lost to a bad path
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    use_threads(threads, quiet=quiet or as_json)
    prompts = make_prompts(texts, lambda s: tokenizer(s, add_special_tokens=False)["input_ids"], tokens,
                           what="training text")
    with progress_steps(len(prompts), "training prompts", quiet=quiet or as_json) as progress:
        weights = learn_head_weights(engine, prompts, feature=feature, ablations=ablations,
                                     max_new_tokens=max_new_tokens, seed=seed, steps=steps,
                                     on_prompt=lambda row: progress.advance(
                                         f"{row.title} ({row.features.shape[-1]} tokens, {row.drops.numel()} deletions)"))
    weights.provenance["texts"] = [str(t) for t in texts]
    save_or_salvage(out, weights.save, what="the weights", flag="-o")
    if as_json:
        print(json.dumps({"out": str(out), **weights.provenance}))
        return
    p = weights.provenance
    Console().print(f"wrote {out}: {tuple(weights.weights.shape)} weights on {feature}; correlation of predicted "
                    f"and measured drops {p['train_correlation']:.3f} (uniform weights: "
                    f"{p['train_correlation_uniform']:.3f}) on the training prompts")
