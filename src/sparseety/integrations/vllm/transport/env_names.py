"""Every ``SPARSEETY_*`` variable SparSEEty reads, and one warning for each set one it does not know.

A misspelled variable (``SPARSEETY_KV_POLCY``) would otherwise leave vLLM running as without it, without a
word. Variables of the project's own tools and tests (``SPARSEETY_CACHE``, ``SPARSEETY_TEST_*``) are known
too, so they never warn. No vLLM, no torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from sparseety.integrations.vllm.transport.values import clipped

#: read inside vLLM (docs/vllm.md)
VLLM_VARIABLES = (
    "SPARSEETY_TRACE_DIR", "SPARSEETY_SAMPLE_RATE", "SPARSEETY_TIER", "SPARSEETY_QUEUE_SIZE", "SPARSEETY_KV_EVENTS",
    "SPARSEETY_REDACT", "SPARSEETY_IDS_ONLY", "SPARSEETY_IMPORTANCE", "SPARSEETY_IMPORTANCE_WAIT_S",
    "SPARSEETY_IMPORTANCE_SHARED_BLOCKS", "SPARSEETY_ROUTING", "SPARSEETY_KV_POLICY", "SPARSEETY_KV_BUDGET",
    "SPARSEETY_KV_RATIO", "SPARSEETY_KV_INTERVAL", "SPARSEETY_KV_POLICY_OPTS", "SPARSEETY_VLLM_CHANNEL",
)
#: read by SparSEEty's own CLI, server and scripts
OWN_VARIABLES = ("SPARSEETY_CACHE", "SPARSEETY_ALLOW_DOWNLOADS", "SPARSEETY_API_KEY", "SPARSEETY_VLLM_VENV")
TEST_PREFIX = "SPARSEETY_TEST_"  #: the test suite's own switches


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """One line per set ``SPARSEETY_*`` variable that nothing reads, naming the closest known one."""
    known = (*VLLM_VARIABLES, *OWN_VARIABLES)
    lines = []
    for name in sorted(env):
        if not name.startswith("SPARSEETY_") or name in known or name.startswith(TEST_PREFIX):
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        lines.append(f"sparseety: {clipped(name)} is not a SparSEEty setting and is ignored{hint}")
    return lines
