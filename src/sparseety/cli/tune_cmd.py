"""``sparseety tune``: the smallest budget of a policy that meets a fidelity or passkey bar."""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli import run_inputs as opt
from sparseety.cli.app import app, user_errors
from sparseety.cli.bounds import MAX_LENGTH
from sparseety.cli.lists import parse_list
from sparseety.cli.output_opts import FILE, check_outputs, output_file
from sparseety.cli.run_inputs import RunInputs
from sparseety.run_file import with_run_file


@app.command("tune")
@user_errors
@with_run_file
def tune_cmd(
    ctx: typer.Context,
    config: Path | None = opt.CONFIG_OPT,
    policy: str | None = typer.Option(None, "--policy", help="KV policy to tune (see `sparseety policies list`); required."),
    metric: str = typer.Option(..., "--metric", help="top1_agreement, mean_kl or passkey."),
    threshold: float = typer.Option(..., "--threshold", help="The bar: >= for top1_agreement and passkey, <= for mean_kl."),
    model: str = opt.MODEL_OPT,
    prompt: str | None = opt.PROMPT_OPT,
    prompt_file: Path | None = opt.PROMPT_FILE_OPT,
    context_file: Path | None = opt.CONTEXT_FILE_OPT,
    question: str | None = opt.QUESTION_OPT,
    chat: bool | None = opt.CHAT_OPT,
    policy_opt: list[str] = opt.POLICY_OPT_OPT,
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Length of the dense continuation (passkey: answer limit)."),
    min_budget: int | None = typer.Option(None, "--min-budget", help="Smallest budget searched (default: the policy's minimum)."),
    max_budget: int | None = typer.Option(None, "--max-budget", help="Largest budget searched (default: one that never evicts)."),
    step: int = typer.Option(1, "--step", help="Budget resolution of the search."),
    lengths: str = typer.Option("1000", "--lengths", help="passkey metric: comma-separated context lengths."),
    depths: str = typer.Option("0.1,0.5,0.9", "--depths", help="passkey metric: comma-separated needle depths."),
    seed: int = opt.SEED_OPT,
    prune_schedule: str | None = opt.PRUNE_SCHEDULE_OPT,
    prune_opt: list[str] = opt.PRUNE_OPT_OPT,
    attention_topk: int | None = opt.ATTENTION_TOPK_OPT,
    out: Path | None = typer.Option(None, "--out", help="Write the tune JSON to this file (rewritten after every "
                                    "evaluated budget).", parser=output_file, metavar="FILE"),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished tune in --out without "
                                "re-evaluating its budgets."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr (as with --json)."),
    as_json: bool = opt.JSON_OPT,
    threads: int | None = opt.THREADS_OPT,
) -> None:
    """Bisect the budget: evaluate the policy at a few budgets and print the curve and the smallest one that meets the bar."""
    from sparseety.analysis.tune import TunePoint, TuneResult, check_metric, check_tunable, tune_fidelity, tune_passkey
    from sparseety.suites.resume import input_contents, previous_run, write_document
    from sparseety.cli.progress import Steps, steps
    from sparseety.engine import SparseEngine
    from sparseety.errors import ConfigError, InputError
    from sparseety.models import load_model
    from sparseety.policies import parse_policy_opts
    from sparseety.threads import use_threads

    check_metric(metric, threshold)
    if policy is None:
        raise InputError("give --policy (or sparsity.policy in --config): the policy whose budget is tuned")
    check_tunable(policy, parse_policy_opts(policy_opt))
    inputs = RunInputs(prompt, prompt_file, context_file, question, chat, policy, 1 << 20, None, policy_opt,
                       prune_schedule=prune_schedule, prune_opt=prune_opt, attention_topk=attention_topk)
    for flag, value in (("--min-budget", min_budget), ("--max-budget", max_budget), ("--step", step)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if metric == "passkey":
        if any(x is not None for x in (prompt, prompt_file, context_file)):
            raise InputError("--metric passkey builds its own cases from --lengths and --depths; "
                             "drop --prompt/--prompt-file/--context-file")
        inputs.check(need_source=False)
        length_list = parse_list(lengths, "--lengths", int, lambda n: 50 <= n <= MAX_LENGTH,
                                 f"50 to {MAX_LENGTH} tokens")
        depth_list = parse_list(depths, "--depths", float, lambda d: 0.0 <= d <= 1.0, "0 <= depth <= 1")
    else:
        inputs.check()
        sources = inputs.read_sources()
    if resume and out is None:
        raise InputError("--resume continues the tune written to --out: give --out FILE")
    settings = {"model": model, "policy": policy, "metric": metric, "threshold": threshold,
                "policy_opt": list(policy_opt), "max_new_tokens": max_new_tokens, "min_budget": min_budget,
                "max_budget": max_budget, "step": step, "seed": seed, "prune_schedule": prune_schedule,
                "prune_opt": list(prune_opt), "attention_topk": attention_topk, "chat": chat,
                "lengths": lengths if metric == "passkey" else None, "depths": depths if metric == "passkey" else None,
                "prompt": prompt, "prompt_file": str(prompt_file) if prompt_file else None,
                "context_file": str(context_file) if context_file else None, "question": question}
    files = [(flag, path) for flag, path in (("--prompt-file", prompt_file), ("--context-file", context_file),
                                             ("--policy-opt model", inputs.options.get("model"))) if path]
    if files:  # a changed file is never reused on --resume; a tune without files keeps the settings it always had
        settings["inputs"] = input_contents((flag, Path(path)) for flag, path in files)
    check_outputs("--out", out, FILE)  # before the model loads
    before = previous_run(out, "tune", settings, resume=resume) if out is not None else None
    known = {int(p["budget"]): float(p["value"]) for p in before["curve"]} if before else None
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    use_threads(threads, quiet=quiet or as_json)
    with ExitStack() as stack:
        progress: list[Steps] = []

        def keep(point: TunePoint, so_far: TuneResult, estimate: int) -> None:
            if out is not None:
                write_document(out, {**so_far.to_json(), "complete": False, "run": settings})
            if not progress:
                progress.append(stack.enter_context(steps(estimate, f"{policy} budgets", quiet=quiet or as_json,
                                                          done=len(known or {}))))
            progress[0].advance(f"budget {point.budget}: {metric} {point.value:.4f} "
                                f"({'meets' if point.meets else 'misses'} the bar)")

        search = dict(options=inputs.options, max_new_tokens=max_new_tokens, min_budget=min_budget,
                      max_budget=max_budget, step=step, seed=seed, known=known, on_point=keep,
                      engine_options={"prune": inputs.prune_for(engine.num_layers), "attention_topk": attention_topk})
        if metric == "passkey":
            from sparseety.suites import make_cases, tokenizer_counter

            cases = make_cases(length_list, depth_list, seed, tokenizer_counter(tokenizer))
            result = tune_passkey(engine, cases, policy, threshold, chat=chat, **search)
        else:
            result = tune_fidelity(engine, inputs.encode(tokenizer, sources), policy, metric, threshold, **search)
    document = {**result.to_json(), "complete": True, "run": settings}
    if out is not None:
        write_document(out, document)
    if as_json:
        sys.stdout.write(json.dumps(document) + "\n")
        return
    print_tune(document, Console())
    if out is not None:
        Console().print(f"wrote {out}")


def print_tune(document: dict[str, Any], console: Console) -> None:
    """The evaluated curve and the answer."""
    table = Table("budget", "ratio", document["metric"], "meets", title=f"{document['policy']}: "
                  f"{document['metric']} {'<=' if document['metric'] == 'mean_kl' else '>='} {document['threshold']:g}")
    for point in document["curve"]:
        table.add_row(str(point["budget"]), f"{point['ratio']:.3f}", f"{point['value']:.4f}",
                      "yes" if point["meets"] else "no")
    console.print(table)
    answer = document["answer"]
    if answer is None:
        console.print("no budget in the searched range meets the bar")
    else:
        console.print(f"answer: budget {answer['budget']} (ratio {answer['ratio']:.3f}), "
                      f"{document['metric']} {answer['value']:.4f}")
