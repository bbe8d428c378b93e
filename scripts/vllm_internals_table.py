"""Rewrite the generated table of ``docs/vllm-internals.md`` from the vLLM adapter's declarations."""

import re
from pathlib import Path

from sparseety.integrations.vllm.vllm_api.adapter import internals_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm-internals.md"
text = DOC.read_text()
table = internals_table()
new = re.sub(r"(<!-- BEGIN internals_table -->\n).*(\n<!-- END internals_table -->)",
             lambda m: m.group(1) + table + m.group(2), text, flags=re.S)
DOC.write_text(new)
print("unchanged" if new == text else f"rewrote the table of {DOC}")
