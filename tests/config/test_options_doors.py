"""Every door builds the same GenerationOptions with no flags: the command line (``run``, ``compare``, a run
file, a batch line), the server (a request under a default configuration, and ``serve``'s flags) and the Python API
(``SparseEngine.generate`` keywords, ``sparseety.load(...).generate``). Issue 38: the Python door and
``ServeConfig()`` used to default to ``importance="attention"``, the command line to ``value``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from tiny_models import build_model, build_tokenizer  # noqa: E402

from sparseety.api import Model  # noqa: E402
from sparseety.cli import app  # noqa: E402
from sparseety.cli.batch_file import BatchLine, line_options  # noqa: E402
from sparseety.cli.run_inputs import RunInputs  # noqa: E402
from sparseety.engine import EncodedInput, SparseEngine  # noqa: E402
from sparseety.errors import InputError  # noqa: E402
from sparseety.options import GenerationOptions, OptionError  # noqa: E402
from sparseety.serve import ServeConfig  # noqa: E402
from sparseety.serve.planning import Plan, request_options  # noqa: E402
from sparseety.serve.tracing import TraceDecision  # noqa: E402

DEFAULTS = GenerationOptions()


class Seen(Exception):
    """Stops a command once it has built its inputs (before any model loads)."""


def cli_options(monkeypatch, *args: str) -> GenerationOptions:
    """The options a command builds from ``args``: RunInputs.check is where the flags become options."""
    seen: list[RunInputs] = []

    def check(self, **_):
        seen.append(self)
        raise Seen

    monkeypatch.setattr(RunInputs, "check", check)
    result = CliRunner().invoke(app, list(args))
    assert isinstance(result.exception, Seen), result.output
    return seen[0].generation_options()


def engine_options(monkeypatch, call) -> GenerationOptions:
    """The options ``SparseEngine.generate`` builds (captured where it checks the request)."""
    seen: list[GenerationOptions] = []

    def check_request(self, encoded, policy, options):
        seen.append(options)
        raise Seen

    monkeypatch.setattr(SparseEngine, "check_request", check_request)
    with pytest.raises(Seen):
        call(SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama"))
    return seen[0]


def test_the_defaults_are_the_faithful_ones():
    assert DEFAULTS.importance == "value" and DEFAULTS.policy == "dense" and DEFAULTS.tier == 2
    assert DEFAULTS.layers == "all" and DEFAULTS.max_new_tokens == 64 and DEFAULTS.top_k == 16


def test_command_line_doors(monkeypatch, tmp_path: Path):
    assert cli_options(monkeypatch, "run", "--prompt", "hi") == DEFAULTS
    assert cli_options(monkeypatch, "compare", "--prompt", "hi") == DEFAULTS
    minimal = tmp_path / "run.yaml"
    minimal.write_text("model:\n  path: smollm2-135m\n")
    assert cli_options(monkeypatch, "run", "--config", str(minimal), "--prompt", "hi") == DEFAULTS
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "hi"}\n')
    flags = cli_options(monkeypatch, "run", "--batch-file", str(batch))
    assert line_options(BatchLine(prompt="hi"), flags) == DEFAULTS


def test_server_door():
    config = ServeConfig()
    plan = Plan(request_id="r", operation="chat", request_model=config.model, encoded=None, policy=None,
                max_tokens=DEFAULTS.max_new_tokens, decision=TraceDecision(tier=config.tier, reason="sampled"),
                seed=0, temperature=None, top_p=None, arrival=0.0, arrival_ns=0)
    assert request_options(config.generation_options(), plan) == DEFAULTS


def test_serve_command_line_door(monkeypatch):
    """``sparseety serve`` with no flags configures the server exactly as ``ServeConfig()`` does."""
    import sparseety.cli.serve_cmd as serve_cmd

    seen: list[dict] = []

    def config_naming_flags(**fields):
        seen.append(fields)
        raise Seen

    monkeypatch.setattr(serve_cmd, "_config_naming_flags", config_naming_flags)
    result = CliRunner().invoke(app, ["serve"])
    assert isinstance(result.exception, Seen), result.output
    assert ServeConfig(**seen[0]) == ServeConfig()
    assert ServeConfig(**seen[0]).generation_options() == ServeConfig().generation_options()


def test_python_doors(monkeypatch):
    ids = EncodedInput(build_tokenizer()("a b c", return_tensors="pt")["input_ids"])
    assert engine_options(monkeypatch, lambda engine: engine.generate(ids)) == DEFAULTS
    assert engine_options(monkeypatch, lambda engine: engine.generate(ids, None, GenerationOptions())) == DEFAULTS
    assert engine_options(monkeypatch, lambda engine: Model(engine).generate("a b c")) == DEFAULTS


def test_keywords_over_options_and_the_policy_they_build(monkeypatch):
    base = GenerationOptions(max_new_tokens=3)
    ids = EncodedInput(build_tokenizer()("a b c", return_tensors="pt")["input_ids"])
    built = engine_options(monkeypatch, lambda engine: engine.generate(ids, "snapkv", base, budget=8, tier=1))
    assert built == dataclasses.replace(DEFAULTS, policy="snapkv", budget=8, max_new_tokens=3, tier=1)


def test_one_check_names_the_field_or_the_flag():
    with pytest.raises(OptionError, match="^importance must be one of attention, value, output, learned, got 'x'"):
        GenerationOptions(importance="x")
    with pytest.raises(OptionError) as info:
        GenerationOptions(max_new_tokens=0)
    assert str(info.value.flag_error()) == "--max-new-tokens must be positive, got 0"
    with pytest.raises(InputError, match="unknown generation option"):
        from sparseety.options import options_from

        options_from(None, budgte=4)
    with pytest.raises(ValueError, match="importance_weights need importance 'learned'"):
        GenerationOptions(importance_weights="w.json")
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.tier = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        DEFAULTS.policy_opts["window"] = 4  # type: ignore[index]


def test_a_dense_batch_line_takes_no_budget_from_the_flags():
    """``dense`` with a budget is refused where the options build their own policy (a batch line, the Python API):
    a dense line does not inherit the flags' budget; one that gives its own is refused alone."""
    flags = GenerationOptions(policy="streaming", budget=16)
    dense = line_options(BatchLine(prompt="hi", policy="dense"), flags)
    assert (dense.policy, dense.budget, dense.ratio) == ("dense", None, None)
    assert dense.policy_for(10).budget is None
    assert line_options(BatchLine(prompt="hi"), flags).budget == 16  # the flags' policy keeps the flags' budget
    with pytest.raises(OptionError, match="^budget 8 is refused: policy 'dense' keeps every token"):
        line_options(BatchLine(prompt="hi", policy="dense", budget=8), flags).policy_for(10)
