"""Fixtures of the trace-store tests: tiny engines (tests/engine/tiny_models.py) and result factories."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from tiny_models import build_model, build_tokenizer

from sparseety.engine import SparseEngine


@pytest.fixture
def one_torch_thread():
    """Tiny models run fastest on one thread on this shared machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_engine() -> Callable[[str], SparseEngine]:
    """``tiny_engine(family)``: one engine per tiny model family for the session."""
    engines: dict[str, SparseEngine] = {}
    tokenizer = build_tokenizer()

    def get(family: str) -> SparseEngine:
        if family not in engines:
            engines[family] = SparseEngine(build_model(family), tokenizer, model_name=f"tiny-{family}")
        return engines[family]

    return get
