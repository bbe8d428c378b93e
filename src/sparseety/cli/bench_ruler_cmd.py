"""``sparseety bench ruler``: RULER-style tasks (needles, variable tracking, common words) per policy and ratio."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import user_errors
from sparseety.cli.bench_cmd import bench_app
from sparseety.cli.bounds import MAX_LENGTH
from sparseety.cli.run_inputs import THREADS_OPT
from sparseety.cli.lists import parse_list
from sparseety.cli.output_opts import DIRECTORY, check_outputs, output_dir
from sparseety.models.registry import DEFAULT_MODEL


@bench_app.command("ruler")
@user_errors
def ruler_cmd(
    tasks: str = typer.Option("niah_single,niah_multikey,niah_multivalue,vt,cwe", "--tasks",
                              help="Comma-separated tasks: niah_single, niah_multikey, niah_multivalue, vt, cwe."),
    policies: str = typer.Option("streaming,snapkv", "--policies", help="Comma-separated policies (any registered)."),
    ratios: str = typer.Option("0.25,0.5,0.75", "--ratios", help="Comma-separated compression ratios in [0, 1)."),
    lengths: str = typer.Option("1000,2000", "--lengths", help="Comma-separated context lengths in tokens."),
    cases: int = typer.Option(3, "--cases", help="Cases per task and length (each its own needle depth)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the cases (keys, values, words and text offsets)."),
    out: Path = typer.Option(Path("bench-ruler"), "-o", "--out", help="Folder for ruler.json, ruler.png and ruler.html.",
                             parser=output_dir, metavar="DIR"),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Built-in name, local directory or Hugging Face id."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens",
                                              help="Answer length limit (default: each task's own, 16 to 48)."),
    chat: bool | None = typer.Option(None, "--chat/--no-chat",
                                     help="Chat template (default: on for chat models; a plain prompt otherwise)."),
    policy_opt: list[str] = typer.Option([], "--policy-opt",
                                         help="POLICY:KEY=VALUE for one policy, KEY=VALUE for all (repeatable)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished run in --out without redoing "
                                "its finished cases (ruler.json is rewritten after every case)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result document as JSON on stdout (no progress)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
    threads: int | None = THREADS_OPT,
) -> None:
    """Generate RULER-style cases from license text; answer each with the context compressed, the question not."""
    from sparseety.suites.ruler import TASKS, make_ruler_cases
    from sparseety.suites.ruler_plot import plot_ruler
    from sparseety.suites.ruler_run import RulerReport, RulerResult, run_ruler
    from sparseety.suites.longdoc import plan_runs
    from sparseety.suites.passkey import tokenizer_counter
    from sparseety.cli.bench_common import (check_policies, finished_results, parse_ratios, policy_file_inputs,
                                            policy_options_by_name, saving_each, write_complete)
    from sparseety.engine import SparseEngine
    from sparseety.errors import ConfigError
    from sparseety.models import load_model
    from sparseety.output_paths import save_or_salvage
    from sparseety.report import write_report
    from sparseety.threads import use_threads

    task_list = parse_list(tasks, "--tasks", str)
    for task in task_list:
        if task not in TASKS:
            raise ConfigError(f"--tasks: unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if len(set(task_list)) != len(task_list):
        raise ConfigError(f"--tasks: each task once, got {tasks!r}")
    names = parse_list(policies, "--policies", str)
    options = policy_options_by_name(policy_opt, names)
    check_policies(policies, options)  # unknown names and options fail before the model loads
    ratio_list = parse_ratios(ratios)
    length_list = parse_list(lengths, "--lengths", int, lambda n: 200 <= n <= MAX_LENGTH, f"200 to {MAX_LENGTH} tokens")
    if cases <= 0:
        raise ConfigError(f"--cases must be positive, got {cases}")
    settings = {"model": model, "tasks": task_list, "policies": names, "ratios": ratio_list, "lengths": length_list,
                "cases": cases, "seed": seed, "max_new_tokens": max_new_tokens, "chat": chat,
                "policy_opt": list(policy_opt)}
    inputs = policy_file_inputs(options)
    if inputs:  # a changed policy file is never reused; a run without one keeps the settings it always had
        settings["inputs"] = inputs
    check_outputs("-o", out, DIRECTORY, ("ruler.json", "ruler.png", "ruler.html"))  # before the model loads
    target = out / "ruler.json"
    finished = finished_results(target, "ruler", settings, RulerResult, resume=resume)  # before the model loads
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    use_threads(threads, quiet=quiet or as_json)
    case_list = make_ruler_cases(task_list, length_list, cases, seed, tokenizer_counter(tokenizer))

    def describe(row: RulerResult) -> str:
        return (f"{row.policy} ratio={row.ratio} {row.task} length={row.length} case={row.index}: "
                f"{row.score:.0%} {row.answer.strip()[:40]!r}")

    with saving_each(target, settings, total=len(plan_runs(case_list, names, ratio_list)), what="ruler cases",
                     finished=finished, describe=describe, quiet=quiet or as_json,
                     document=lambda rows: RulerReport(model=model, seed=seed, cases=case_list, results=rows).to_json(),
                     ) as keep:
        report = run_ruler(engine, case_list, names, ratio_list, model=model, seed=seed, max_new_tokens=max_new_tokens,
                           chat=chat, options=options, on_result=keep, finished=finished)
    document = write_complete(target, report.to_json(), settings)
    figure = save_or_salvage(out / "ruler.png", lambda path: plot_ruler(document, path), what="the figure", flag="-o")
    page = save_or_salvage(out / "ruler.html", lambda path: write_report(target, path), what="the report", flag="-o")
    if as_json:
        print(json.dumps(document))
        return
    print_ruler_tables(document, Console())
    Console().print(f"wrote {target}, {figure} and {page}")


def print_ruler_tables(document: dict[str, Any], console: Console) -> None:
    """Recall by policy x ratio for each task, then over all tasks."""
    tables = [*document["by_task"].items(), ("all tasks", document["accuracy"])]
    columns = sorted({k for table in document["accuracy"].values() for k in table}, key=float)
    for title, rows in tables:
        table = Table("policy", *(f"ratio {c}" for c in columns), title=f"{title}: recall")
        for policy, row in rows.items():
            table.add_row(policy, *(f"{row[c]:.0%}" if c in row else "-" for c in columns))
        console.print(table)
