"""Every ``python`` example of docs/python.md runs, in order, in one namespace, on the real default model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_there_are_examples():
    assert len(BLOCK.findall(PAGE.read_text(encoding="utf-8"))) >= 5


@pytest.mark.model
def test_every_example_runs(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing the examples write lands in the repository
    namespace: dict[str, object] = {}
    for number, code in enumerate(BLOCK.findall(PAGE.read_text(encoding="utf-8")), start=1):
        exec(compile(code, f"docs/python.md example {number}", "exec"), namespace)  # noqa: S102
    assert namespace["result"].options.importance == "value"
