"""The Python API refuses every bad value and wrong type with :class:`sparseety.errors.InputError` naming the
argument, before any work (docs/python.md): no raw TypeError, AttributeError, AssertionError or ConfigError."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import sparseety
from sparseety.api import Model
from sparseety.errors import InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tiny_models import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model() -> Model:
    """The API over a tiny random Llama (4 layers, vocab 160): the checks need no real model."""
    from sparseety.engine import SparseEngine

    return Model(SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama"))


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "float7"}, "dtype must be one of float32, float16, bfloat16, float64, got 'float7'"),
    ({"dtype": 32}, "dtype must be one of"),
    ({"device": "gpu9"}, "device must be a device name such as 'cpu' or 'cuda:0', got 'gpu9'"),
    ({"device": 0}, "device must be a device name"),
    ({"device": "cuda"}, "device 'cuda': this machine has no CUDA device"),
    ({"model": 42}, "model must be a built-in name, a local directory or a Hugging Face id, got 42"),
    ({"model": ""}, "model must be"),
])
def test_load_refuses_bad_arguments_before_reading_weights(kwargs, words, monkeypatch):
    import torch

    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from sparseety import api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(InputError) as info:
        sparseety.load(**{"model": "smollm2-135m", **kwargs})
    assert words in str(info.value)


@pytest.mark.parametrize("prompt, fields, words", [
    (42, {}, "prompt must be a text or a non-empty list of texts, got 42"),
    ({"a": "b"}, {}, "prompt must be a text or a non-empty list of texts, got {'a': 'b'}"),
    ([], {}, "prompt must be a text or a non-empty list of texts"),
    (["ok", 3], {}, "prompt must be a text or a non-empty list of texts"),
    ("hi", {"policy": "streaming", "budget": "16"}, "budget must be a whole number, got '16'"),
    ("hi", {"policy": "streaming", "budget": True}, "budget must be a whole number, got True"),
    ("hi", {"policy": "streaming", "budget": 16.0}, "budget must be a whole number, got 16.0"),
    ("hi", {"policy": "snapkv", "ratio": True}, "ratio must be a number in [0, 1), got True"),
    ("hi", {"policy": "snapkv", "ratio": "0.5"}, "ratio must be a number in [0, 1), got '0.5'"),
    ("hi", {"policy": "streaming", "budget": 0}, "budget: budget must be a positive integer, got 0"),
    ("hi", {"policy": "streaming", "budget": 2}, "budget: "),
    ("hi", {"policy": "nope", "budget": 8}, "budget: unknown policy 'nope'"),
    ("hi", {"policy": "nope"}, "policy: unknown policy 'nope'"),
    ("hi", {"policy": 7}, "policy must be a policy name"),
    ("hi", {"policy": "streaming", "budget": 16, "policy_opts": None}, "policy_opts must be a mapping"),
    ("hi", {"policy": "streaming", "budget": 16, "policy_opts": {"bogus": 1}}, "unknown option 'bogus'"),
    ("hi", {"policy": "dense", "budget": 16}, "policy 'dense' keeps every token, so it takes no budget"),
    ("hi", {"policy": "dense", "ratio": 0.5}, "policy 'dense' keeps every token"),
    ("hi", {"max_new_tokens": True}, "max_new_tokens must be a whole number, got True"),
    ("hi", {"max_new_tokens": "8"}, "max_new_tokens must be a whole number, got '8'"),
    ("hi", {"tier": 2.0}, "tier must be a whole number"),
    ("hi", {"min_score": "0.1"}, "min_score must be a number in [0, 1), got '0.1'"),
    ("hi", {"importance": "loud"}, "importance must be one of attention, value, output, learned"),
    ("hi", {"colour": "red"}, "unknown generation option(s) 'colour'"),
])
def test_generate_refuses_bad_values_with_input_error_naming_them(model, prompt, fields, words, monkeypatch):
    monkeypatch.setattr(model.engine, "generate", lambda *a, **k: pytest.fail("generation started"))
    monkeypatch.setattr(model.engine, "generate_batch", lambda *a, **k: pytest.fail("generation started"))
    with pytest.raises(InputError) as info:
        model.generate(prompt, **fields)
    assert words in str(info.value)


@pytest.mark.parametrize("chat", ["yes", 1, "false"])
def test_chat_is_a_boolean_or_none(model, chat):
    with pytest.raises(InputError, match="chat must be True, False or None"):
        model.generate("hi", chat=chat)
    with pytest.raises(InputError, match="chat must be True, False or None"):
        model.compare("hi", chat=chat, policy="streaming", budget=16)


def test_options_must_be_generation_options(model):
    with pytest.raises(InputError, match="options must be a GenerationOptions or None"):
        model.generate("hi", {"policy": "streaming"})


def test_engine_generate_takes_token_ids_as_documented(model):
    engine = model.engine
    ids = engine.tokenizer("The sky is")["input_ids"]
    by_ids = engine.generate(ids, "streaming", budget=16, max_new_tokens=3, tier=1)
    by_text = engine.generate("The sky is", "streaming", budget=16, max_new_tokens=3, tier=1)
    import torch

    by_tensor = engine.generate(torch.tensor(ids), "streaming", budget=16, max_new_tokens=3, tier=1)
    assert list(by_ids.prompt_ids) == ids and by_ids.output_ids == by_tensor.output_ids
    assert len(by_ids.output_ids) == 3 and by_text.output_ids  # text is encoded (chat template on chat models)


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
