"""Fixtures for the analysis tests: tiny random models from ``tests/engine/tiny_models.py`` and one torch thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tiny_models import build_model, build_tokenizer


@pytest.fixture(scope="session")
def tiny_engine():
    """A :class:`SparseEngine` on the tiny Llama (4 layers, 2 KV heads, vocab 160)."""
    from sparseety.engine import SparseEngine

    return SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama")


@pytest.fixture()
def one_thread():
    """Tiny models run faster on one thread on this loaded machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
