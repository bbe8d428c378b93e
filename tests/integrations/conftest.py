"""The vLLM side venv: the tests that need it skip only where it is absent outside CI; in CI they fail."""

from __future__ import annotations

import os

import pytest

from vllm_server import VENV, VLLM


def require_vllm() -> None:
    if VLLM.is_file():
        return
    reason = f"the vLLM side venv {VENV} is absent: build it with `bash scripts/setup-vllm.sh`"
    if os.environ.get("CI"):
        pytest.fail(reason + " (CI runs scripts/setup.sh --test, which builds it)")
    pytest.skip(reason)
