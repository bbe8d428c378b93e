"""The training tests run tiny models (``tests/engine/tiny_models.py``, importable from here) on one thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_torch_thread):
    """Every test here runs tiny models on one torch thread (``one_torch_thread``, tests/conftest.py)."""
