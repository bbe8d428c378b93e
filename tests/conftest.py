"""Shared fixtures: the real default model, loaded once per test session (converted from GGUF on first use)."""

from __future__ import annotations

import pytest

from sparseety.models import load_model


@pytest.fixture(scope="session")
def smollm():
    """``(model, tokenizer)`` of the default model, never wrapped by an engine (a plain reference)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_engine():
    """A :class:`SparseEngine` on its own copy of the default model."""
    from sparseety.engine import SparseEngine

    model, tokenizer = load_model("smollm2-135m")
    return SparseEngine(model, tokenizer, "smollm2-135m")


@pytest.fixture(scope="session")
def gemma():
    """``(model, tokenizer)`` of Gemma 3 270M (the second built-in model), never wrapped by an engine."""
    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma_engine():
    """A :class:`SparseEngine` on its own copy of Gemma 3 270M."""
    from sparseety.engine import SparseEngine

    model, tokenizer = load_model("gemma3-270m")
    return SparseEngine(model, tokenizer, "gemma3-270m")
