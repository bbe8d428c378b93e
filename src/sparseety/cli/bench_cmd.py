"""``sparseety bench passkey``: needle-in-a-haystack accuracy per policy and ratio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli import run_inputs as opt
from sparseety.cli.app import app, user_errors
from sparseety.cli.bounds import MAX_LENGTH
from sparseety.cli.lists import parse_list
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
    out: Path = typer.Option(Path("bench-passkey"), "--out", help="Folder for passkey.json and passkey.png."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Built-in name, local directory or Hugging Face id."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Answer length limit."),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", help="Chat template (default: on for chat models)."),
    prune_schedule: str | None = opt.PRUNE_SCHEDULE_OPT,
    prune_opt: list[str] = opt.PRUNE_OPT_OPT,
    attention_topk: int | None = opt.ATTENTION_TOPK_OPT,
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished run in --out without redoing "
                                "its finished cases (passkey.json is rewritten after every case)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress on stderr."),
) -> None:
    """Hide a pass key in license text at each length and depth; ask for it with the context compressed."""
    from sparseety.bench import PasskeyReport, PasskeyResult, make_cases, run_passkey, tokenizer_counter
    from sparseety.bench.passkey_plot import plot_passkey
    from sparseety.bench.passkey_run import plan_cases
    from sparseety.bench.resume import previous_run, write_document
    from sparseety.cli.progress import steps
    from sparseety.engine import SparseEngine
    from sparseety.errors import ConfigError, InputError
    from sparseety.models import load_model
    from sparseety.policies import build_policy

    names = parse_list(policies, "--policies", str)
    for name in names:
        build_policy(name, 1 << 20)  # unknown names fail before the model loads
    ratio_list = parse_list(ratios, "--ratios", float, lambda r: 0.0 <= r < 1.0, "0 <= ratio < 1")
    length_list = parse_list(lengths, "--lengths", int, lambda n: 50 <= n <= MAX_LENGTH,
                                 f"50 to {MAX_LENGTH} tokens")
    depth_list = parse_list(depths, "--depths", float, lambda d: 0.0 <= d <= 1.0, "0 <= depth <= 1")
    if max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    extras = RunInputs(prune_schedule=prune_schedule, prune_opt=prune_opt, attention_topk=attention_topk)
    extras.check(need_source=False)
    settings = {"model": model, "policies": names, "ratios": ratio_list, "lengths": length_list, "depths": depth_list,
                "seed": seed, "max_new_tokens": max_new_tokens, "chat": chat, "prune_schedule": prune_schedule,
                "prune_opt": list(prune_opt), "attention_topk": attention_topk}
    target = out / "passkey.json"
    before = previous_run(target, "passkey", settings, resume=resume)  # before the model loads
    try:
        finished = [PasskeyResult(**row) for row in before["results"]] if before else []
    except (TypeError, KeyError) as exc:
        raise InputError(f"cannot resume from {target}: its results are not passkey results ({exc})") from None
    lm, tokenizer = load_model(model)
    engine = SparseEngine(lm, tokenizer, model)
    engine_options = {"prune": extras.prune_for(engine.num_layers), "attention_topk": attention_topk}
    cases = make_cases(length_list, depth_list, seed, tokenizer_counter(tokenizer))
    total = len(plan_cases(cases, names, ratio_list))
    kept = list(finished)

    with steps(total, "passkey cases", quiet=quiet, done=len(finished)) as progress:
        def keep(row: PasskeyResult) -> None:
            kept.append(row)
            so_far = PasskeyReport(model=model, seed=seed, cases=cases, results=kept).to_json()
            write_document(target, {**so_far, "complete": False, "run": settings})
            mark = "ok" if row.correct else "miss"
            progress.advance(f"{row.policy} ratio={row.ratio} length={row.length} depth={row.depth}: {mark} "
                             f"{row.answer.strip()[:40]!r}")

        report = run_passkey(engine, cases, names, ratio_list, model=model, seed=seed, max_new_tokens=max_new_tokens,
                             chat=chat, on_result=keep, engine_options=engine_options, finished=finished)
    document = {**report.to_json(), "complete": True, "run": settings}
    write_document(target, document)
    plot_passkey(document, out / "passkey.png")
    print_tables(document, Console())
    Console().print(f"wrote {target} and {out / 'passkey.png'}")


def print_tables(document: dict[str, Any], console: Console) -> None:
    """Accuracy by policy x ratio, and by policy x depth."""
    for title, key, label in (("accuracy by ratio", "accuracy", "ratio"), ("accuracy by depth", "by_depth", "depth")):
        columns = sorted({k for table in document[key].values() for k in table}, key=float)
        table = Table("policy", *(f"{label} {c}" for c in columns), title=title)
        for policy, row in document[key].items():
            table.add_row(policy, *(f"{row[c]:.0%}" if c in row else "-" for c in columns))
        console.print(table)
