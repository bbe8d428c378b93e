"""The converted default model is a plain Hugging Face checkpoint, and older caches are migrated on load.

vLLM (and any loader that ties the head to the embedding) needs ``architectures`` in ``config.json`` and
the tied tensor under ``model.embed_tokens.weight``; older SparSEEty caches had neither.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparseety.models.gguf_cache import EMBED_KEY, HEAD_KEY, WEIGHTS, migrate_cache, needs_migration
from sparseety.models.registry import resolve_model_dir

pytestmark = pytest.mark.model

PROMPTS = ["The GNU General Public License is", "Write one sentence about a lighthouse."]


def _keys(folder: Path) -> set[str]:
    with safe_open(str(folder / WEIGHTS), framework="np") as handle:
        return set(handle.keys())


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(str(folder / WEIGHTS), framework="np") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


def _greedy(folder: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=12, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


def _write_old_layout(current: Path, old: Path) -> None:
    """What SparSEEty wrote before: safetensors.save_model kept the tied pair as lm_head.weight only,
    and config.save_pretrained of a GGUF-loaded model left ``architectures`` out."""
    shutil.copytree(current, old)
    tensors = _tensors(current)
    tensors[HEAD_KEY] = tensors.pop(EMBED_KEY)
    (old / WEIGHTS).unlink()
    save_file(tensors, str(old / WEIGHTS), metadata={"format": "pt"})
    config = json.loads((old / "config.json").read_text())
    del config["architectures"]
    (old / "config.json").write_text(json.dumps(config, indent=2))


#: run in two processes at once: the directory the default model resolves to and its inode once resolved
RESOLVE = ("import os; from sparseety.models.registry import resolve_model_dir; "
           "d = resolve_model_dir('smollm2-135m'); print(d, os.stat(d).st_ino)")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, monkeypatch_module):
    """The default model converted from its GGUF file by the current code, into an empty cache, asked for by two
    processes at once (as test workers and a server's processes do): both get the one directory the first
    built, never replaced by the second's conversion under it."""
    root = tmp_path_factory.mktemp("cache")
    env = {**os.environ, "SPARSEETY_CACHE": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    answers = [proc.communicate(timeout=600)[0].split() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    folder = Path(answers[0][0])
    assert answers[0] == answers[1] == [str(folder), str(os.stat(folder).st_ino)]
    monkeypatch_module.setenv("SPARSEETY_CACHE", str(root))
    assert Path(resolve_model_dir("smollm2-135m")) == folder and folder.is_relative_to(root)
    yield folder
    shutil.rmtree(root, ignore_errors=True)  # 0.5 GB per copy: not left for pytest's kept temp dirs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_conversion_writes_a_hugging_face_checkpoint(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    keys = _keys(converted)
    assert EMBED_KEY in keys and HEAD_KEY not in keys
    assert len(keys) == 272  # 30 layers x 9 tensors + embedding + final norm
    assert not needs_migration(converted)
    assert not any(p.name.startswith("smollm2-135m.") for p in converted.parent.iterdir())  # no temp dir left


def test_old_cache_is_migrated_on_load_with_identical_weights_and_tokens(converted, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    old = root / "models" / "smollm2-135m"
    old.parent.mkdir(parents=True)
    _write_old_layout(converted, old)
    assert needs_migration(old)
    before = _greedy(old)  # transformers ties the embedding to the saved head, so the old layout runs here
    monkeypatch.setenv("SPARSEETY_CACHE", str(root))
    assert Path(resolve_model_dir("smollm2-135m")) == old
    assert not needs_migration(old)
    config = json.loads((old / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    migrated, reference = _tensors(old), _tensors(converted)
    assert set(migrated) == set(reference)
    for key, value in reference.items():
        assert value.dtype == migrated[key].dtype and np.array_equal(value, migrated[key]), key
    assert _greedy(old) == before == _greedy(converted)
    assert migrate_cache(old) is False  # idempotent
    shutil.rmtree(root)


def test_interrupted_migration_finishes_on_next_load(converted, tmp_path):
    old = tmp_path / "smollm2-135m"
    _write_old_layout(converted, old)
    # weights already migrated, config not yet: still detected, and only the config is rewritten
    tensors = _tensors(old)
    tensors[EMBED_KEY] = tensors.pop(HEAD_KEY)
    save_file(tensors, str(old / WEIGHTS), metadata={"format": "pt"})
    mtime = (old / WEIGHTS).stat().st_mtime_ns
    assert needs_migration(old)
    assert migrate_cache(old) is True
    assert (old / WEIGHTS).stat().st_mtime_ns == mtime
    assert json.loads((old / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not needs_migration(old)
    # the other half: config fixed, weights still head-only
    old2 = tmp_path / "second"
    _write_old_layout(converted, old2)
    config = json.loads((old2 / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (old2 / "config.json").write_text(json.dumps(config))
    assert needs_migration(old2) and migrate_cache(old2) and not needs_migration(old2)
    assert EMBED_KEY in _keys(old2) and HEAD_KEY not in _keys(old2)
    shutil.rmtree(old)
    shutil.rmtree(old2)
