"""Native sliding-window attention (Gemma 3 style): which layers have a window, and what it hides.

A sliding layer of window ``w`` lets the query at position ``p`` see keys at positions
``p - w + 1 .. p`` (transformers' rule: ``kv > q - w``). The hook point applies the window itself
(transformers builds no mask for the project's attention function), the cache frees what fell out
of it, and the trace records, per step and sliding layer, the *window edge* of the step's newest
query: every position below it was invisible there. Readers expand an edge to positions ``0 .. edge - 1``.
"""

from __future__ import annotations

from typing import Any

import torch


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer, its sliding window in tokens, or None for a global layer.

    Reads ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``) with ``sliding_window``;
    a config with a window but no layer types (Mistral style) slides on every layer.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    layers = text.num_hidden_layers
    if not window:
        return (None,) * layers
    types = getattr(text, "layer_types", None)
    if types is None:
        return (int(window),) * layers
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def window_edge(position: int, window: int) -> int:
    """The first position a query at ``position`` still sees (0 when nothing is hidden yet)."""
    return max(0, position - window + 1)


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[b, kv_heads, q, n]`` bool: key visible to query (causal, and inside the window when there is one).

    Parameters
    ----------
    query_positions : ``[q]`` positions of the new rows.
    key_positions : ``[b, kv_heads, n]`` position of every slot.
    """
    keys = key_positions.unsqueeze(-2)  # [b, kvh, 1, n]
    queries = query_positions.view(1, 1, -1, 1)
    visible = keys <= queries
    if window is not None:
        visible &= keys > queries - window
    return visible


def hidden_by_window(key_positions: torch.Tensor, next_position: int, window: int) -> torch.Tensor:
    """``[b, kv_heads, n]`` bool: slots no query from ``next_position`` on can see any more."""
    return key_positions < window_edge(next_position, window)
