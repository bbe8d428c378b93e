"""A checkpoint's fingerprint read from its files equals the loaded model's (what vLLM's worker checks a
surrogate against), and differs between models and after a weight changes."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from sparseety.fingerprint import checkpoint_fingerprint, model_fingerprint
from sparseety.models.registry import resolve_model_dir


@pytest.mark.model  # the fixture is looked up by name, so the conftest cannot see it
@pytest.mark.parametrize("fixture", ["smollm", "gemma"])
def test_checkpoint_files_give_the_loaded_models_fingerprint(request, fixture):
    model, _ = request.getfixturevalue(fixture)
    name = {"smollm": "smollm2-135m", "gemma": "gemma3-270m"}[fixture]
    assert checkpoint_fingerprint(resolve_model_dir(name)) == model_fingerprint(model)


def test_another_weight_gives_another_fingerprint(tmp_path, smollm):
    source = resolve_model_dir("smollm2-135m")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    weights = next(copy.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    assert checkpoint_fingerprint(copy) != model_fingerprint(smollm[0]) == checkpoint_fingerprint(source)
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(resolve_model_dir("gemma3-270m"))
