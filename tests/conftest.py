"""Shared fixtures: the real default model, loaded once per test session (converted from GGUF on first use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparseety.models import load_model

#: the session fixtures that load a real built-in model; a test that uses one (directly or through another
#: fixture, e.g. ``real_trace`` or serve's ``engine``) gets the ``model`` marker, so ``-m "not model"`` skips it
REAL_MODEL_FIXTURES = frozenset({"smollm", "smollm_engine", "gemma", "gemma_engine"})


#: every test in this folder runs the real default model (or Gemma) end to end
END_TO_END = Path(__file__).resolve().parent / "end_to_end"


def _starts_vllm(item: pytest.Item) -> bool:
    """A test module that imports the vLLM launcher (``tests/vllm_observer/vllm_server.py``) starts vLLM processes."""
    module = getattr(item, "module", None)
    return module is not None and getattr(getattr(module, "require_vllm", None), "__module__", None) == "vllm_server"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or END_TO_END in Path(item.path).parents:
            item.add_marker(pytest.mark.model)
        if _starts_vllm(item):
            item.add_marker(pytest.mark.vllm)


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


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test, restored afterwards. Tiny models are dominated by per-op overhead: with
    two threads on a loaded 2-core machine every 64x64 matmul spins for milliseconds (measured 1.2 s against
    0.03 s per 12-token run). Folders of tiny-model tests use it for every test; the real model keeps its
    threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
