"""Fixtures of the trace-store tests: tiny engines (tests/engine/tiny_models.py) and result factories."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from tiny_models import build_model, build_tokenizer

from sparseety.engine import SparseEngine


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
