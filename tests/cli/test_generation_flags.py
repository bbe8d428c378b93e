"""``run`` and ``compare`` take their generation flags from one declaration
(:data:`sparseety.cli.generation_flags.GENERATION_FLAGS`): the same flags, defaults, help and order in both,
every value reaching the command's ``RunInputs``, run files filling them by parameter name."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.cli.generation_flags import GENERATION_FLAGS, INPUT_FIELDS, generation_flags
from sparseety.cli.run_inputs import RunInputs

SHARED = [name for name, _, _ in GENERATION_FLAGS]


class Seen(Exception):
    """Stops a command once it has its inputs (before any model loads)."""


def click_params(command: str) -> list:
    return typer.main.get_command(app).commands[command].params  # type: ignore[attr-defined]


def described(param) -> tuple:
    return (param.name, tuple(param.opts), tuple(param.secondary_opts), param.default, param.help, param.multiple)


@pytest.mark.parametrize("command", ["run", "compare"])
def test_the_shared_flags_follow_config_in_their_declared_order(command):
    names = [p.name for p in click_params(command)]
    assert names[:len(SHARED) + 1] == ["config", *SHARED]


def test_run_and_compare_declare_the_shared_flags_alike():
    run = [described(p) for p in click_params("run") if p.name in SHARED]
    compare = [described(p) for p in click_params("compare") if p.name in SHARED]
    assert run == compare and len(run) == len(SHARED)


CHANGED = ["--prompt", "hi", "--chat", "--policy", "h2o", "--budget", "24", "--policy-opt", "recent_ratio=0.5",
           "--max-new-tokens", "5", "--tier", "3", "--top-k", "4", "--min-score", "0.1", "--importance", "attention",
           "--speculative", "2", "--prune-schedule", "8:0.3", "--prune-opt", "keep_recent=4",
           "--attention-topk", "8", "--layers", "0,1", "--seed", "7"]
EXPECTED = dict(prompt="hi", chat=True, policy="h2o", budget=24, policy_opt=["recent_ratio=0.5"], max_new_tokens=5,
                tier=3, top_k=4, min_score=0.1, importance="attention", speculative=2, prune_schedule="8:0.3",
                prune_opt=["keep_recent=4"], attention_topk=8, layers="0,1", seed=7)


def inputs_of(monkeypatch, *args: str) -> RunInputs:
    seen: list[RunInputs] = []

    def check(self, **_):
        seen.append(self)
        raise Seen

    monkeypatch.setattr(RunInputs, "check", check)
    result = CliRunner().invoke(app, list(args))
    assert isinstance(result.exception, Seen), result.output
    return seen[0]


@pytest.mark.parametrize("command", ["run", "compare"])
def test_every_shared_value_reaches_the_inputs(monkeypatch, command):
    inputs = inputs_of(monkeypatch, command, *CHANGED)
    assert {name: getattr(inputs, name) for name in EXPECTED} == EXPECTED
    assert inputs.prompt_file is None and inputs.context_file is None and inputs.ratio is None
    assert set(EXPECTED) | {"prompt_file", "context_file", "question", "ratio", "importance_weights"} == set(INPUT_FIELDS)


def test_a_run_file_fills_the_shared_flags_by_name(monkeypatch, tmp_path: Path):
    config = tmp_path / "c.yaml"
    config.write_text("sparsity: {policy: snapkv, kv_cache_limit: 32}\nextraction: {top_k: 3, importance: output}\n")
    inputs = inputs_of(monkeypatch, "compare", "--config", str(config), "--prompt", "hi", "--top-k", "5")
    assert (inputs.policy, inputs.budget, inputs.top_k, inputs.importance) == ("snapkv", 32, 5, "output")


def test_a_command_without_inputs_is_refused_at_import():
    def command(ctx: typer.Context, model: str, trace_dir: Path, as_json: bool) -> None: ...

    with pytest.raises(TypeError, match="no parameter inputs"):
        generation_flags(command)
