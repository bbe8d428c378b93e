"""Every numeric flag of every command has a bounded range: far above it, far below it, NaN and
infinity are each one ``error:`` line and exit code 2 (never an ``OverflowError`` or a traceback), and
the check comes before any model is loaded."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.cli.bounds import BOUNDS
from sparseety.store.retention import parse_period

#: the least each command needs besides the flag under test (the range check comes first)
REQUIRED: dict[str, list[str]] = {
    "audit-usage": ["--base-url", "http://127.0.0.1:9", "--model", "smollm2-135m", "--requests", "r.jsonl"],
    "query": ["SELECT 1"],
    "extract": ["r.json"],
    "gc": ["--older-than", "7d"],
    "report": ["traces"],
    "tune": ["--metric", "mean_kl", "--threshold", "0.1", "--policy", "h2o", "--prompt", "hi"],
    "analyze bias": ["traces"],
    "traces show": ["some-id"],
    "run": ["--prompt", "hi"],
    "compare": ["--prompt", "hi"],
    "learn-policy": ["traces", "-o", "policy.safetensors"],
    "learn-importance": ["text.txt", "-o", "weights.json"],
}


def commands():
    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield " ".join(path), cmd

    return list(walk(typer.main.get_command(app), []))


def numeric_flags() -> list[tuple[str, str, str, type]]:
    """(command, parameter, flag, int or float) for every numeric flag of every command."""
    found = []
    for name, cmd in commands():
        # the hints Typer reads: a decorator may add flags to the signature (sparseety.cli.generation_flags)
        hints = typing.get_type_hints(cmd.callback)
        for param in cmd.params:
            hint = str(hints.get(param.name, ""))
            kind = int if "int" in hint else float if "float" in hint else None
            if kind is not None and param.opts[0].startswith("--"):
                found.append((name, param.name, param.opts[0], kind))
    return found


FLAGS = numeric_flags()


def test_every_numeric_flag_has_a_range():
    assert len(FLAGS) > 40
    shared = {"--budget", "--ratio", "--max-new-tokens", "--tier", "--top-k", "--min-score", "--speculative",
              "--attention-topk", "--seed"}  # the generation flags run and compare take from one declaration
    for command in ("run", "compare"):
        assert shared <= {flag for name, _, flag, _ in FLAGS if name == command}, command
    missing = sorted({p for _, p, _, _ in FLAGS} - set(BOUNDS))
    assert not missing, f"numeric flags without a range in sparseety.cli.bounds: {missing}"


def invoke(command: str, flag: str, value: str, cwd: Path):
    args = [*command.split(), *REQUIRED.get(command, []), flag, value]
    return CliRunner().invoke(app, args)


def assert_one_error(result, flag: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("command", "param", "flag", "kind"), FLAGS, ids=[f"{c}:{f}" for c, _, f, _ in FLAGS])
def test_far_out_of_range_values_are_one_error_line(command, param, flag, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values = ["1" + "0" * 30, "-" + "1" + "0" * 30]
    if kind is float:
        values += ["nan", "inf", "-inf", "1e309"]
    for value in values:
        result = invoke(command, flag, value, tmp_path)
        assert_one_error(result, flag)


@pytest.mark.parametrize("period", ["99999999999999d", "9999999999999999999w", "1000000d"])
def test_huge_periods_are_refused(period: str, tmp_path: Path):
    from sparseety.errors import InputError

    with pytest.raises(InputError, match="retention period"):
        parse_period(period)
    for command in (["gc", "--older-than", period], ["gc", "--older-than", "7d", "--grace", period],
                    ["traces", "check", "--grace", period]):
        result = CliRunner().invoke(app, [*command, "--trace-dir", str(tmp_path)])
        assert_one_error(result, "--older-than")
