"""Session fixtures: one wrapped engine per tiny model family, and plain-greedy references.

The models and helpers live in ``tiny_models.py`` (importable from the tests of this folder).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny_models import build_model, build_tokenizer
from transformers import PreTrainedTokenizerFast

from sparseety.engine import SparseEngine


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_torch_thread):
    """Every test here runs tiny models on one torch thread (``one_torch_thread``, tests/conftest.py)."""


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def engine_for(tokenizer: PreTrainedTokenizerFast) -> Callable[[str], SparseEngine]:
    """``engine_for(family)``: one wrapped engine per family for the whole session."""
    engines: dict[str, SparseEngine] = {}

    def get(family: str) -> SparseEngine:
        if family not in engines:
            engines[family] = SparseEngine(build_model(family), tokenizer, model_name=f"tiny-{family}")
        return engines[family]

    return get


@pytest.fixture(scope="session")
def reference_model() -> Callable[[str], torch.nn.Module]:
    """``reference_model(family)``: an identical, never-wrapped build for plain ``generate``."""
    built: dict[str, torch.nn.Module] = {}

    def get(family: str) -> torch.nn.Module:
        if family not in built:
            built[family] = build_model(family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def greedy_reference(reference_model: Callable[[str], torch.nn.Module]) -> Callable[..., list[int]]:
    """``greedy_reference(family, ids, new_tokens)``: plain transformers greedy generation (new ids only)."""
    cache: dict[tuple, list[int]] = {}

    def get(family: str, ids: torch.Tensor, new_tokens: int) -> list[int]:
        key = (family, tuple(ids[0].tolist()), new_tokens)
        if key not in cache:
            model = reference_model(family)
            assert model.config._attn_implementation == "sdpa"  # never wrapped
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=False)
            cache[key] = out[0, ids.shape[1]:].tolist()
        return cache[key]

    return get
