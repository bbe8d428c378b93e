"""``docs/vllm-internals.md`` lists exactly what the vLLM adapter declares (no vLLM needed)."""

from __future__ import annotations

import re
from pathlib import Path

from sparseety.integrations.vllm.vllm_api import adapter

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-internals.md"


def test_the_internals_doc_is_the_adapters_declarations():
    text = DOC.read_text()
    match = re.search(r"<!-- BEGIN internals_table -->\n(.*)\n<!-- END internals_table -->", text, re.S)
    assert match, "docs/vllm-internals.md lost its generated table markers"
    assert match.group(1) == adapter.internals_table(), (
        "docs/vllm-internals.md differs from the adapter's declarations; regenerate the table with "
        ".venv/bin/python scripts/vllm_internals_table.py")


def test_every_hook_has_needs_and_every_need_a_known_hook():
    needs = (*adapter.NEEDS, *adapter.IMPL_NEEDS)
    assert {n.hook for n in needs} == set(adapter.HOOKS)
    assert len({(n.hook, n.owner, n.name) for n in needs}) == len(needs), "a need declared twice"
    for hook in adapter.HOOKS:
        assert any(n.hook == hook for n in needs), hook
