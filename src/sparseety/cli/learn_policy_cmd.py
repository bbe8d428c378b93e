"""``sparseety learn-policy``: train the ``learned`` policy's predictor from tier-3 traces, or (``--target kvzip``)
the ``kvzap`` policy's surrogate from KVzip+ scores of the traced prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import app, user_errors
from sparseety.cli.output_opts import FILE, check_outputs, output_file
from sparseety.cli.run_inputs import THREADS_OPT


@app.command("learn-policy")
@user_errors
def learn_policy_cmd(
    trace_dir: Path = typer.Argument(..., help="Trace dataset holding tier-3 traces (sparseety run --tier 3)."),
    out: Path = typer.Option(..., "-o", "--out", help="Predictor file to write (safetensors).", parser=output_file,
                             metavar="FILE"),
    model: str | None = typer.Option(None, "--model", help="Model to replay the prefills on (default: the one "
                                     "the traces name); traces of other models are ignored."),
    epochs: int = typer.Option(30, "--epochs", help="Passes over the training slots."),
    hidden: int = typer.Option(16, "--hidden", help="Hidden units of the MLP (0: a logistic model)."),
    lr: float = typer.Option(3e-3, "--lr", help="Adam learning rate."),
    label: str = typer.Option("max", "--label", help="How a position's attention from later steps is reduced "
                              "before ranking: max (the most one step gave it), sum, or question (the question forward's "
                              "row only: the query that writes the first answer token)."),
    label_top: float = typer.Option(0.02, "--label-top", help="Share of the context's positions labelled as "
                                    "heavy hitters (by attention received from later steps)."),
    holdout: float = typer.Option(0.25, "--holdout", help="Share of the requests held out for the metrics (0: none held "
                                 "out, and no held-out figure is measured)."),
    max_examples: int = typer.Option(300_000, "--max-examples", help="Training slots at most (evenly subsampled)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split, the subsample and the initial weights."),
    text_source: str = typer.Option("unspecified", "--text-source", help="What text the traces were made from "
                                    "(recorded in the file's provenance)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (metrics and provenance)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
    threads: int | None = THREADS_OPT,
    target: str = typer.Option("attention", "--target", help="What to learn: attention (the learned policy, "
                               "labels from later steps' attention in tier-3 traces) or kvzip (the kvzap policy's "
                               "surrogate, regressing the KVzip+ scores of each traced prompt; tier-2 or tier-3 traces)."),
    surrogate: str = typer.Option("linear", "--surrogate", help="With --target kvzip: linear (ridge, per layer) "
                                  "or mlp (--hidden wide, --epochs, --lr)."),
) -> None:
    """Replay each traced prefill, label positions by the attention later steps gave them, fit a tiny predictor,
    print its held-out ranking quality against h2o, tova and recency, and write it with its provenance."""
    from sparseety.training.learned_policy import LABELS, TrainConfig, learn, read_examples
    from sparseety.engine import SparseEngine
    from sparseety.errors import ConfigError
    from sparseety.models import load_model
    from sparseety.output_paths import save_or_salvage
    from sparseety.threads import use_threads

    checks = [(epochs >= 1, f"--epochs must be at least 1, got {epochs}"),
              (0 <= hidden <= 1024, f"--hidden must be in 0..1024, got {hidden}"),
              (0 < lr <= 1, f"--lr must be in (0, 1], got {lr}"),
              (0 < label_top < 1, f"--label-top must be in (0, 1), got {label_top}"),
              (label in LABELS, f"--label must be one of {', '.join(LABELS)}, got {label!r}"),
              (0 <= holdout < 1, f"--holdout must be in [0, 1), got {holdout}"),
              (max_examples >= 100, f"--max-examples must be at least 100, got {max_examples}")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if out.suffix != ".safetensors":
        raise ConfigError(f"-o must name a .safetensors file, got {out}")
    check_outputs("-o", out, FILE)  # before the model loads (both targets): the fit is never lost to a bad path
    if target not in ("attention", "kvzip"):
        raise ConfigError(f"--target must be attention or kvzip, got {target!r}")
    if target == "kvzip":
        _learn_kvzip(trace_dir, out, model, surrogate, hidden, epochs, lr, holdout, max_examples, seed, text_source,
                     as_json, quiet, threads)
        return
    examples = read_examples(trace_dir, model, label)  # before the model loads: an empty dataset fails at once
    name = model or examples[0].model
    say = (lambda m: None) if quiet or as_json else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"{len(examples)} tier-3 requests of model {name}; loading it to replay their prefills")
    lm, tokenizer = load_model(name)
    engine = SparseEngine(lm, tokenizer, name)
    use_threads(threads, quiet=quiet or as_json)
    config = TrainConfig(epochs=epochs, hidden=hidden, lr=lr, label=label, label_top=label_top, holdout=holdout,
                         max_examples=max_examples, seed=seed)
    result = learn(engine, examples, config, trace_dir=str(trace_dir), text_source=text_source, on_progress=say)
    path = save_or_salvage(out, result.predictor.save, what="the predictor", flag="-o")
    if as_json:
        print(json.dumps({"out": str(path), "metrics": result.metrics,
                          "provenance": result.predictor.provenance}, indent=2))
        return
    console = Console()
    if result.metrics is None:
        console.print(no_heldout_note(holdout, len(examples)))
    else:
        keys = sorted({k for row in result.metrics.values() for k in row})
        table = Table("method", *keys, title=f"held-out ranking quality ({len(result.heldout_requests)} requests): "
                      "share of the next steps' top-attended positions kept")
        for method, row in result.metrics.items():
            table.add_row(method, *(f"{row[k]:.3f}" for k in keys))
        console.print(table)
    console.print(f"wrote {path} (trained for {result.predictor.model}, {result.predictor.model_fingerprint}, "
                  f"{result.examples} slots from {len(result.train_requests)} requests)")


def _learn_kvzip(trace_dir: Path, out: Path, model: str | None, surrogate: str, hidden: int, epochs: int, lr: float,
                 holdout: float, max_examples: int, seed: int, text_source: str, as_json: bool, quiet: bool,
                 threads: int | None) -> None:
    """``--target kvzip``: fit the kvzap surrogate, print its held-out fidelity per layer, write it."""
    from sparseety.training.kvzap_surrogate import KVzapConfig, learn_kvzap, read_contexts
    from sparseety.engine import SparseEngine
    from sparseety.errors import ConfigError
    from sparseety.models import load_model
    from sparseety.output_paths import save_or_salvage
    from sparseety.policies.parts.kvzap_model import SURROGATES
    from sparseety.threads import use_threads

    if surrogate not in SURROGATES:
        raise ConfigError(f"--surrogate must be one of {', '.join(SURROGATES)}, got {surrogate!r}")
    if surrogate == "mlp" and hidden < 1:
        raise ConfigError(f"--hidden must be at least 1 for --surrogate mlp, got {hidden}")
    contexts = read_contexts(trace_dir, model)  # before the model loads: an empty dataset fails at once
    name = model or contexts[0].model
    say = (lambda m: None) if quiet or as_json else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"{len(contexts)} traced prompts of model {name}; loading it to score them with KVzip+")
    lm, tokenizer = load_model(name)
    engine = SparseEngine(lm, tokenizer, name)
    use_threads(threads, quiet=quiet or as_json)
    config = KVzapConfig(surrogate=surrogate, hidden=hidden, epochs=epochs, lr=lr, holdout=holdout,
                         max_examples=max_examples, seed=seed)
    result = learn_kvzap(engine, contexts, config, trace_dir=str(trace_dir), text_source=text_source, on_progress=say)
    path = save_or_salvage(out, result.surrogate.save, what="the surrogate", flag="-o")
    provenance = result.surrogate.provenance
    if as_json:
        print(json.dumps({"out": str(path), "heldout": result.per_layer, "heldout_mean": provenance["heldout_mean"],
                          "provenance": provenance}, indent=2))
        return
    console = Console()
    mean = provenance["heldout_mean"]
    if mean is None:
        console.print(no_heldout_note(holdout, len(contexts)))
    else:
        table = Table("layer", "spearman", "recall@0.5", title=f"held-out fidelity to KVzip+ "
                      f"({len(result.heldout_requests)} requests): rank correlation, and the share of KVzip+'s kept "
                      "set at ratio 0.5 kept")
        for row in result.per_layer:
            table.add_row(str(row["layer"]), f"{row['spearman']:.3f}", f"{row['recall@0.5']:.3f}")
        table.add_row("mean", f"{mean['spearman']:.3f}", f"{mean['recall@0.5']:.3f}")
        console.print(table)
    console.print(f"wrote {path} ({result.surrogate.kind} surrogate for {result.surrogate.model}, "
                  f"{result.surrogate.model_fingerprint}, {result.tokens} tokens from {len(result.train_requests)} requests)")


def no_heldout_note(holdout: float, requests: int) -> str:
    """What is printed instead of the held-out table when no request was held out."""
    why = "--holdout 0" if holdout <= 0 else f"a single request ({requests} in the dataset)"
    return (f"no held-out set ({why}): nothing was measured on requests the fit never saw, and the file stores "
            "no held-out figure; trace more requests and give --holdout above 0 to measure one")
