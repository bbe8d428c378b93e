"""vLLM's request ids and layer names, read as SparSEEty needs them. No vLLM, no torch."""

from __future__ import annotations

import os
import re

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


def external_id(internal_id: str) -> str:
    """The id the client knows (the one the store and its sampling use): vLLM appends ``-`` and 8
    random characters to it unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set."""
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "").strip() not in ("", "0"):
        return internal_id
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


def layer_number(name: str) -> int | None:
    """The first ``.<n>.`` of a layer's name (``model.layers.3.self_attn.attn`` -> 3)."""
    match = _LAYER_NUMBER.search(name + ".")
    return int(match.group(1)) if match else None
