"""The training tests run tiny models (``tests/engine/tiny_models.py``, importable from here) on one thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models are dominated by per-op overhead; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
