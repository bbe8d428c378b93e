"""``sparseety bench passkey``: needle-in-a-haystack accuracy per policy and ratio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli import run_inputs as opt
from sparseety.cli.app import app, user_errors
from sparseety.cli.lists import parse_list
from sparseety.cli.output_opts import DIRECTORY, check_outputs, output_dir
from sparseety.cli.run_inputs import RunInputs
from sparseety.models.registry import DEFAULT_MODEL
from sparseety.run_file import with_run_file

bench_app = typer.Typer(help="Benchmarks of sparse policies.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("passkey")
@user_errors
@with_run_file
def passkey_cmd(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="Run configuration YAML (see examples/run.yaml); flags override it."),
    policies: str = typer.Option("streaming,snapkv", "--policies", help="Comma-separated policies."),
    ratios: str = typer.Option("0.25,0.5,0.75", "--ratios", help="Comma-separated compression ratios in [0, 1)."),
    lengths: str = typer.Option("1000,2000", "--lengths", help="Comma-separated context lengths in tokens."),
    depths: str = typer.Option("0.1,0.5,0.9", "--depths", help="Comma-separated needle depths in [0, 1]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the cases (pass keys and text offsets)."),
    out: Path = typer.Option(Path("bench-passkey"), "--out", help="Folder for passkey.json and passkey.png.",
                             parser=output_dir, metavar="DIR"),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Built-in name, local directory or Hugging Face id."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Answer length limit."),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", help="Chat template (default: on for chat models)."),
    prune_schedule: str | None = opt.PRUNE_SCHEDULE_OPT,
    prune_opt: list[str] = opt.PRUNE_OPT_OPT,
    attention_topk: int | None = opt.ATTENTION_TOPK_OPT,
    policy_opt: list[str] = typer.Option([], "--policy-opt", help="POLICY:KEY=VALUE for one policy of --policies, "
                                         "KEY=VALUE for all (repeatable), e.g. learned:model=policy.safetensors."),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished run in --out without redoing "
                                "its finished cases (passkey.json is rewritten after every case)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
    threads: int | None = opt.THREADS_OPT,
) -> None:
    """Hide a pass key in license text at each length and depth; ask for it with the context compressed."""
    from sparseety.suites import PasskeyReport, PasskeyResult, make_cases, run_passkey, tokenizer_counter
    from sparseety.suites.passkey_plot import plot_passkey
    from sparseety.suites.passkey_run import plan_cases
    from sparseety.cli.bench_common import (check_policies, finished_results, parse_lengths, parse_ratios,
                                            policy_file_inputs, policy_options_by_name, saving_each,
                                            write_complete)
    from sparseety.engine import SparseEngine
    from sparseety.models import load_model
    from sparseety.output_paths import save_or_salvage
    from sparseety.threads import use_threads

    names = parse_list(policies, "--policies", str)
    options = policy_options_by_name(policy_opt, names)
    names = check_policies(policies, options)  # unknown names or options fail before the model loads
    ratio_list = parse_ratios(ratios)
    length_list = parse_lengths(lengths)
    depth_list = parse_list(depths, "--depths", float, lambda d: 0.0 <= d <= 1.0, "0 <= depth <= 1")
    extras = RunInputs(prune_schedule=prune_schedule, prune_opt=prune_opt, attention_topk=attention_topk)
    extras.check(need_source=False)
    settings = {"model": model, "policies": names, "ratios": ratio_list, "lengths": length_list, "depths": depth_list,
                "seed": seed, "max_new_tokens": max_new_tokens, "chat": chat, "prune_schedule": prune_schedule,
                "prune_opt": list(prune_opt), "attention_topk": attention_topk}
    if policy_opt:  # only when given, so runs started before the flag existed still resume
        settings["policy_opt"] = list(policy_opt)
    inputs = policy_file_inputs(options)
    if inputs:  # likewise: a run without policy files keeps the settings it always had
        settings["inputs"] = inputs
    check_outputs("--out", out, DIRECTORY, ("passkey.json", "passkey.png"))  # before the model loads
    target = out / "passkey.json"
    finished = finished_results(target, "passkey", settings, PasskeyResult, resume=resume)  # before the model loads
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    use_threads(threads, quiet=quiet)
    engine_options = {"prune": extras.prune_for(engine.num_layers), "attention_topk": attention_topk}
    cases = make_cases(length_list, depth_list, seed, tokenizer_counter(tokenizer))

    def describe(row: PasskeyResult) -> str:
        return (f"{row.policy} ratio={row.ratio} length={row.length} depth={row.depth}: "
                f"{'ok' if row.correct else 'miss'} {row.answer.strip()[:40]!r}")

    with saving_each(target, settings, total=len(plan_cases(cases, names, ratio_list)), what="passkey cases",
                     finished=finished, describe=describe, quiet=quiet,
                     document=lambda rows: PasskeyReport(model=model, seed=seed, cases=cases, results=rows).to_json(),
                     ) as keep:
        report = run_passkey(engine, cases, names, ratio_list, model=model, seed=seed, max_new_tokens=max_new_tokens,
                             chat=chat, on_result=keep, engine_options=engine_options, finished=finished,
                             policy_options=options)
    document = write_complete(target, report.to_json(), settings)
    figure = save_or_salvage(out / "passkey.png", lambda path: plot_passkey(document, path), what="the figure",
                             flag="--out")
    print_tables(document, Console())
    Console().print(f"wrote {target} and {figure}")


def print_tables(document: dict[str, Any], console: Console) -> None:
    """Accuracy by policy x ratio, and by policy x depth."""
    for title, key, label in (("accuracy by ratio", "accuracy", "ratio"), ("accuracy by depth", "by_depth", "depth")):
        columns = sorted({k for table in document[key].values() for k in table}, key=float)
        table = Table("policy", *(f"{label} {c}" for c in columns), title=title)
        for policy, row in document[key].items():
            table.add_row(policy, *(f"{row[c]:.0%}" if c in row else "-" for c in columns))
        console.print(table)
