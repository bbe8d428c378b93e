"""In the API server: a finished request's sliding-window rows and window-freed memory, from the engine
core's KV-cache groups and frees (:mod:`.window_frees`).

``window`` rows are written exactly as SparSEEty's own engine writes them (:mod:`sparseety.engine.window`):
one row per step that emits a token (step 0 is the prefill that completes the prompt, step ``s`` feeds the
``s``-th output token's predecessor) and per sliding-window layer whose window hides something, with
``position`` the window edge of the step's newest query (position ``P + s - 1`` for a prompt of ``P``
tokens): the first position it still saw, ``max(0, P + s - w)``. The windows are vLLM's own, per layer
from its KV-cache groups (``SlidingWindowSpec.sliding_window``); a query at ``p`` sees keys
``p - w + 1 .. p``, the rule of vLLM's kernels and of the own engine. The rows depend on the tokens only,
so a prompt prefilled in chunks, or partly served from the prefix cache, gives the same rows.

``skipped_events`` counts, as the own engine does, per emitting step and sliding layer the hidden
positions times the layer's KV heads.

What vLLM freed (``extra_json.vllm.window``): per free, ``[step, group, blocks, bytes]`` with ``step`` the
step being scheduled when vLLM freed them (0 while the prompt is prefilled), and the totals.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparseety.integrations.vllm.vllm_api.messages import KVGroup
from sparseety.integrations.vllm.transport.record import EventGroup


def layer_windows(groups: list[KVGroup]) -> dict[int, int]:
    """Decoder layer -> its sliding window, for the layers of windowed groups."""
    return {layer: g.window for g in groups if g.window for layer in g.layers}


def window_events(groups: list[KVGroup], sequence: list[int], prompt_len: int,
                  outputs: int) -> tuple[dict[str, np.ndarray], int]:
    """``(window.* arrays, skipped_events)`` of a request of ``prompt_len`` prompt and ``outputs`` output tokens."""
    from sparseety.engine.window import window_edge  # the own engine's rule (imported here: it loads torch)

    windows = layer_windows(groups)
    heads = {layer: g.kv_heads for g in groups if g.window for layer in g.layers}
    rows = EventGroup()
    skipped = 0
    for step in range(outputs):
        newest = prompt_len + step - 1
        for layer in sorted(windows):
            edge = window_edge(newest, windows[layer])
            if edge > 0:
                skipped += edge * heads[layer]
                rows.add(step, layer, edge, sequence[edge] if edge < len(sequence) else -1, float("nan"))
    return (rows.arrays("window") if len(rows) else {}), skipped


def freed(groups: list[KVGroup], frees: list[list[int]], prompt_len: int) -> dict[str, Any]:
    """``extra_json.vllm.window``: the layers' windows and what the windowed groups freed, with bytes."""
    rows = []
    for computed, group, blocks in frees:
        step = 0 if computed < prompt_len else computed - prompt_len + 1
        rows.append([step, group, blocks, blocks * groups[group].block_bytes if 0 <= group < len(groups) else 0])
    return {
        "layers": {str(layer): w for layer, w in sorted(layer_windows(groups).items())},
        "freed_blocks": sum(r[2] for r in rows),
        "freed_bytes": sum(r[3] for r in rows),
        "frees": rows,
    }
