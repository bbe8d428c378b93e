"""The Python API refuses every bad value and wrong type with :class:`sparseety.errors.InputError` naming the
argument, before any work (docs/python.md): no raw TypeError, AttributeError, AssertionError or a bare ConfigError.

A refusal of the policy registry, the pruning-schedule parser or the engine's checks against the model is an
:class:`~sparseety.options.OptionRefusal`: an InputError with ``field`` set that stays the ConfigError it was, with
the same message from every door (the command line's are pinned at the end)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import sparseety
from sparseety.api import Model
from sparseety.cli import app
from sparseety.errors import ConfigError, InputError
from sparseety.options import GenerationOptions, OptionError, OptionRefusal, is_int, is_number

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tiny_models import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model() -> Model:
    """The API over a tiny random Llama (4 layers, vocab 160): the checks need no real model."""
    from sparseety.engine import SparseEngine

    return Model(SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama"))


@pytest.fixture
def no_work(model, monkeypatch):
    """Any generation, batch or run context opened fails the test: the refusal must come first."""
    for name in ("generate", "generate_batch", "open_run"):
        monkeypatch.setattr(model.engine, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} started"))
    return model


def test_a_number_is_an_int_or_float_that_is_not_a_bool():
    assert is_int(3) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert is_number(0.5) and is_number(2) and not is_number(False) and not is_number("0.5")


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "float7"}, "dtype must be one of float32, float16, bfloat16, float64, got 'float7'"),
    ({"dtype": 32}, "dtype must be one of"),
    ({"device": "gpu9"}, "device must be a device name such as 'cpu' or 'cuda:0', got 'gpu9'"),
    ({"device": 0}, "device must be a device name"),
    ({"device": "cuda"}, "device 'cuda': this machine has no CUDA device"),
    ({"device": "x" * 500}, "... (500 chars)"),
    ({"model": 42}, "model must be a built-in name, a local directory or a Hugging Face id, got 42"),
    ({"model": ""}, "model must be"),
])
def test_load_refuses_bad_arguments_before_reading_weights(kwargs, words, monkeypatch):
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from sparseety import api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(InputError) as info:
        sparseety.load(**{"model": "smollm2-135m", **kwargs})
    assert words in str(info.value)


#: (prompt, keywords, the argument refused, words of the message)
BAD = [
    (42, {}, "prompt", "prompt must be a text or a non-empty list of texts, got 42"),
    ({"a": "b"}, {}, "prompt", "prompt must be a text or a non-empty list of texts, got {'a': 'b'}"),
    ([], {}, "prompt", "prompt must be a text or a non-empty list of texts"),
    (["ok", 3], {}, "prompt", "prompt must be a text or a non-empty list of texts"),
    ("hi", {"policy": "streaming", "budget": "16"}, "budget", "budget must be a whole number, got '16'"),
    ("hi", {"policy": "streaming", "budget": True}, "budget", "budget must be a whole number, got True"),
    ("hi", {"policy": "streaming", "budget": 16.0}, "budget", "budget must be a whole number, got 16.0"),
    ("hi", {"policy": "snapkv", "ratio": True}, "ratio", "ratio must be a number in [0, 1), got True"),
    ("hi", {"policy": "snapkv", "ratio": "0.5"}, "ratio", "ratio must be a number in [0, 1), got '0.5'"),
    ("hi", {"policy": "snapkv", "ratio": float("nan")}, "ratio", "ratio must be a finite number in [0, 1), got nan"),
    ("hi", {"policy": "snapkv", "budget": 0}, "budget", "budget must be a positive integer, got 0"),
    ("hi", {"policy": "streaming", "budget": 2}, "budget", "budget (2) must be >= sinks (4)"),
    ("hi", {"policy": "snapkv"}, "budget", "policy 'snapkv' needs --budget N or --ratio R"),
    ("hi", {"policy": "h2o", "policy_opts": {"recent_ratio": 0.5}}, "budget", "needs --budget N or --ratio R"),
    ("hi", {"policy": "snapkv", "budget": 8, "ratio": 0.5}, "budget", "either --budget or --ratio, not both"),
    ("t4 t5 t6 t7", {"policy": "streaming", "ratio": 0.9}, "ratio", "ratio 0.9 leaves 1 of the prompt's"),
    ("hi", {"policy": "nope", "budget": 8}, "policy", "unknown policy 'nope'"),
    ("hi", {"policy": "nope"}, "policy", "unknown policy 'nope'"),
    ("hi", {"policy": 7}, "policy", "policy must be a policy name"),
    ("hi", {"policy": "streaming", "budget": 16, "policy_opts": None}, "policy_opts", "policy_opts must be a mapping"),
    ("hi", {"policy": "streaming", "budget": 16, "policy_opts": {"bogus": 1}}, "policy_opts",
     "streaming: unknown option 'bogus'; valid options: sinks"),
    ("hi", {"policy": "h2o", "budget": 16, "policy_opts": {"recent_ratio": True}}, "policy_opts",
     "h2o: option recent_ratio must be a number, got bool True"),
    ("hi", {"policy": "h2o", "budget": 16, "policy_opts": {"recent_ratio": 2.0}}, "policy_opts",
     "h2o: recent_ratio must be in [0, 1), got 2.0"),
    ("hi", {"policy": "dense", "budget": 16}, "budget",
     "budget 16 is refused: policy 'dense' keeps every token, so it takes no budget or ratio"),
    ("hi", {"policy": "dense", "ratio": 0.5}, "ratio", "ratio 0.5 is refused: policy 'dense' keeps every token"),
    (["hi", "there"], {"policy": "dense", "budget": 16}, "budget", "policy 'dense' keeps every token"),
    ("hi", {"max_new_tokens": True}, "max_new_tokens", "max_new_tokens must be a whole number, got True"),
    ("hi", {"max_new_tokens": "8"}, "max_new_tokens", "max_new_tokens must be a whole number, got '8'"),
    ("hi", {"tier": 2.0}, "tier", "tier must be a whole number"),
    ("hi", {"tier": True}, "tier", "tier must be a whole number, got True"),
    ("hi", {"top_k": False}, "top_k", "top_k must be a whole number, got False"),
    ("hi", {"seed": True}, "seed", "seed must be a whole number, got True"),
    ("hi", {"speculative": True}, "speculative", "speculative must be a whole number, got True"),
    ("hi", {"attention_topk": True}, "attention_topk", "attention_topk must be a whole number, got True"),
    ("hi", {"min_score": "0.1"}, "min_score", "min_score must be a number in [0, 1), got '0.1'"),
    ("hi", {"min_score": False}, "min_score", "min_score must be a number in [0, 1), got False"),
    ("hi", {"importance": "loud"}, "importance", "importance must be one of attention, value, output, learned"),
    ("hi", {"layers": True}, "layers", "layers must be all, auto or layer numbers, got True"),
    ("hi", {"prune": 5}, "prune", "prune must be a schedule such as '8:0.3,16:0.5' or 'default'"),
    ("hi", {"prune": "zz"}, "prune", "prune schedule: 'zz' is not layer:fraction"),
    ("hi", {"prune": "1:0.5", "prune_opts": {"foo": "1"}}, "prune_opts", "unknown option 'foo'"),
    ("hi", {"prune_opts": None}, "prune_opts", "prune_opts must be a mapping"),
    ("hi", {"colour": "red"}, None, "unknown generation option(s) 'colour'"),
]


@pytest.mark.parametrize("prompt, fields, argument, words", BAD)
def test_generate_refuses_bad_values_with_input_error_naming_them(no_work, prompt, fields, argument, words):
    with pytest.raises(InputError) as info:
        no_work.generate(prompt, **fields)
    assert words in str(info.value)
    if isinstance(info.value, OptionError):
        assert info.value.field == argument
    # the message names what was refused: the argument, or the option within policy_opts or prune_opts
    keys = [*(fields.get("policy_opts") or {}), *(fields.get("prune_opts") or {})]
    assert any(name in str(info.value) for name in [argument or "colour", *keys])


@pytest.mark.parametrize("prompt, fields, argument, words",
                         [case for case in BAD if isinstance(case[0], str) and "colour" not in case[1]])
def test_the_engine_door_refuses_them_alike(model, prompt, fields, argument, words, monkeypatch):
    """``model.engine.generate`` takes the same keywords (the policy by name) and refuses before a run opens."""
    monkeypatch.setattr(model.engine, "open_run", lambda *a, **k: pytest.fail("a run was opened"))
    fields = dict(fields)
    policy = fields.pop("policy", None)
    with pytest.raises(InputError) as info:
        model.engine.generate(prompt, policy, **fields)
    assert words in str(info.value)


def test_a_policy_refusal_is_an_input_error_and_stays_a_config_error():
    """GenerationOptions built by hand (docs/python.md, one options object) refuses the same way."""
    with pytest.raises(OptionRefusal) as info:
        GenerationOptions(policy="snapkv", budget=0)
    assert isinstance(info.value, InputError) and isinstance(info.value, ConfigError)
    assert info.value.field == "budget" and info.value.flag_error() is info.value


@pytest.mark.parametrize("fields, argument, words", [
    ({"layers": "x"}, "layers", "'x' is not a layer number"),
    ({"layers": [99]}, "layers", "layer 99 is outside the model's layers 0..3"),
    ({"prune": "9:0.5"}, "prune", "9"),
    ({"policy": "kvzip", "budget": 4, "prune": "1:0.5"}, "prune", "kvzip' cannot be combined with token pruning"),
    ({"policy": "kvzip", "budget": 4, "speculative": 2}, "speculative", "cannot be combined with speculative"),
])
def test_what_the_model_refuses_is_an_input_error_before_the_run(model, fields, argument, words, monkeypatch):
    monkeypatch.setattr(model.engine, "open_run", lambda *a, **k: pytest.fail("a run was opened"))
    with pytest.raises(OptionRefusal) as info:
        model.generate("t4 t5 t6 t7 t8 t9 t10 t11", max_new_tokens=2, **fields)
    assert isinstance(info.value, InputError) and info.value.field == argument and words in str(info.value)


@pytest.mark.parametrize("chat", ["yes", 1, "false"])
def test_chat_is_a_boolean_or_none(no_work, chat):
    with pytest.raises(InputError, match="chat must be True, False or None"):
        no_work.generate("hi", chat=chat)
    with pytest.raises(InputError, match="chat must be True, False or None"):
        no_work.compare("hi", chat=chat, policy="streaming", budget=16)


def test_options_must_be_generation_options(no_work):
    with pytest.raises(InputError, match="options must be a GenerationOptions or None, got {'policy': 'streaming'}"):
        no_work.generate("hi", {"policy": "streaming"})
    with pytest.raises(InputError, match="options must be a GenerationOptions or None"):
        no_work.compare("hi", "streaming")
    with pytest.raises(InputError, match="policy 'dense' keeps every token"):
        no_work.generate("hi", GenerationOptions(policy="dense", budget=4))


def test_engine_generate_takes_token_ids_as_documented(model):
    engine = model.engine
    ids = engine.tokenizer("t10 t11 t12")["input_ids"]
    by_ids = engine.generate(ids, "streaming", budget=16, max_new_tokens=3, tier=1)
    by_text = engine.generate("t10 t11 t12", "streaming", budget=16, max_new_tokens=3, tier=1)
    by_tensor = engine.generate(torch.tensor(ids), "streaming", budget=16, max_new_tokens=3, tier=1)
    assert list(by_ids.prompt_ids) == ids and by_ids.output_ids == by_tensor.output_ids == by_text.output_ids
    assert len(by_ids.output_ids) == 3


@pytest.mark.parametrize("bad, words", [
    ([], "token ids must be a non-empty list"),
    ([1, True], "encoded must be text, token ids"),
    ([1, 2.5], "encoded must be text, token ids"),
    ([-1], "token ids must be a non-empty list of ids in [0, "),
    ([10**9], "token ids must be a non-empty list of ids in [0, "),
    (42, "encoded must be text, token ids (a list of ints) or an EncodedInput, got 42"),
])
def test_engine_generate_refuses_bad_token_ids(model, bad, words):
    with pytest.raises(InputError) as info:
        model.engine.generate(bad, "streaming", budget=16, max_new_tokens=2)
    assert words in str(info.value)


@pytest.mark.parametrize("policy, options", [(5, None), ({"name": "h2o"}, None), (None, {"policy": "h2o"})])
def test_engine_generate_refuses_a_policy_or_options_of_the_wrong_type(model, policy, options):
    with pytest.raises(InputError, match="^(policy|options) must be"):
        model.engine.generate([5, 6, 7], policy, options)


# -- the command line keeps its messages: a policy refusal is the registry's own words ---------------------------


@pytest.mark.parametrize("args, stderr", [
    (["--policy", "h2o", "--budget", "0"], "error: budget must be a positive integer, got 0\n"),
    (["--policy", "streaming", "--budget", "2"], "error: streaming: budget (2) must be >= sinks (4)\n"),
    (["--policy", "h2o"], "error: policy 'h2o' needs --budget N or --ratio R\n"),
    (["--policy", "h2o", "--budget", "8", "--ratio", "0.5"], "error: give either --budget or --ratio, not both\n"),
    (["--policy", "h2o", "--budget", "8", "--policy-opt", "recent_ratio=2"],
     "error: h2o: recent_ratio must be in [0, 1), got 2.0\n"),
    (["--policy", "h2o", "--ratio", "1.0"], "error: --ratio must be in [0, 1), got 1.0\n"),
    (["--prune-schedule", "zz"], "error: prune schedule: 'zz' is not layer:fraction (example: 8:0.3,16:0.5)\n"),
])
def test_the_command_line_messages_are_unchanged(args, stderr):
    result = CliRunner().invoke(app, ["run", "--prompt", "hi", "--model", "/no/such/model", *args])
    assert result.exit_code == 2 and result.stderr == stderr
