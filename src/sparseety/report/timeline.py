"""Rebuild the eviction timeline of a run from its eviction events and sliding-window edges.

An eviction recorded at step ``s`` means the position is gone from that layer and KV head from
step ``s`` on (prefill is step 0). At step ``s`` the sequence holds ``prompt_len + s`` positions, so a
position ``p >= prompt_len + s`` is not yet seen. A sliding-window layer's edge at step ``s``
(``window.*``) hides every position below it from that step's query.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEVER = -1  #: marker for "never evicted" in :class:`EvictionTimeline` step arrays


@dataclass
class EvictionTimeline:
    """Per layer and position, when KV heads evicted it.

    Attributes
    ----------
    first_step : ``[layers, positions]`` int64, step the first KV head evicted the position, or ``NEVER``.
    all_step : ``[layers, positions]`` int64, step from which every KV head had evicted it, or ``NEVER``.
    heads_evicted : ``[layers, positions]`` int64, KV heads that evicted it by the end of the run.
    kept_per_step : ``[layers, steps]`` float64, slots held at each step, mean over KV heads.
    window_edge : ``[layers, steps]`` int64, first position a sliding layer's query still saw (0: none hidden).
    kv_heads : KV heads per layer.
    steps : number of steps (prefill is step 0, so the last step is ``steps - 1``).
    prompt_len : prompt tokens.
    """

    first_step: np.ndarray
    all_step: np.ndarray
    heads_evicted: np.ndarray
    kept_per_step: np.ndarray
    kv_heads: int
    steps: int
    prompt_len: int
    window_edge: np.ndarray | None = None

    def seq_len(self, step: int, positions: int) -> int:
        """Positions seen at ``step`` (never more than ``positions``)."""
        return min(self.prompt_len + step, positions)

    def state(self, layer: int, step: int) -> np.ndarray:
        """``[positions]`` int8: 0 not yet seen, 1 kept, 2 evicted by some KV heads, 3 evicted by all,
        4 outside a sliding layer's window (and not evicted by every head)."""
        n = self.first_step.shape[1]
        first, full = self.first_step[layer], self.all_step[layer]
        out = np.zeros(n, dtype=np.int8)
        seen = np.arange(n) < self.seq_len(step, n)
        out[seen] = 1
        out[seen & (first != NEVER) & (first <= step)] = 2
        if self.window_edge is not None:
            out[seen & (np.arange(n) < self.window_edge[layer, step])] = 4
        out[seen & (full != NEVER) & (full <= step)] = 3
        return out


def build_timeline(
    arrays: dict[str, np.ndarray], *, num_layers: int, positions: int, kv_heads: int, steps: int, prompt_len: int
) -> EvictionTimeline:
    """Reconstruct the timeline from ``evicted.{step,layer,kv_head,position}`` (absent: nothing evicted).

    Parameters
    ----------
    arrays : the trace arrays; only the ``evicted.*`` columns are read.
    num_layers, positions, kv_heads : the extent of the grid (events outside it are ignored).
    steps : number of steps (rows of the timeline), at least 1.
    prompt_len : prompt tokens, so that step ``s`` sees ``prompt_len + s`` positions.
    """
    steps = max(1, steps)
    big = np.iinfo(np.int64).max
    first_by_head = np.full((num_layers, kv_heads, positions), big, dtype=np.int64)
    if "evicted.step" in arrays and len(arrays["evicted.step"]):
        step = np.asarray(arrays["evicted.step"], dtype=np.int64)
        layer = np.asarray(arrays["evicted.layer"], dtype=np.int64)
        head = np.asarray(arrays["evicted.kv_head"], dtype=np.int64)
        pos = np.asarray(arrays["evicted.position"], dtype=np.int64)
        inside = (layer >= 0) & (layer < num_layers) & (head >= 0) & (head < kv_heads) & (pos >= 0) & (pos < positions)
        np.minimum.at(first_by_head, (layer[inside], head[inside], pos[inside]), step[inside])
    evicted = first_by_head != big
    first = np.where(evicted.any(axis=1), first_by_head.min(axis=1), NEVER)
    full = np.where(evicted.all(axis=1), np.where(evicted, first_by_head, -big).max(axis=1), NEVER)
    kept = np.zeros((num_layers, steps), dtype=np.float64)
    seq = np.minimum(prompt_len + np.arange(steps), positions)
    for layer_index in range(num_layers):
        when = first_by_head[layer_index][evicted[layer_index]]
        gone = np.cumsum(np.bincount(np.minimum(when, steps - 1), minlength=steps)[:steps])
        kept[layer_index] = seq - gone / kv_heads
    edges = window_edges(arrays, num_layers=num_layers, steps=steps, positions=positions)
    if edges is not None:  # a sliding layer frees what its window hides: only what no head evicted counts again
        for layer_index in np.flatnonzero(edges.any(axis=1)):
            for step_index in np.flatnonzero(edges[layer_index]):
                below = first_by_head[layer_index][:, : edges[layer_index, step_index]]
                kept[layer_index, step_index] -= (below > step_index).sum() / kv_heads
    return EvictionTimeline(
        first_step=first, all_step=full, heads_evicted=evicted.sum(axis=1), kept_per_step=kept,
        kv_heads=kv_heads, steps=steps, prompt_len=prompt_len, window_edge=edges,
    )


def window_edges(arrays: dict[str, np.ndarray], *, num_layers: int, steps: int, positions: int) -> np.ndarray | None:
    """``[layers, steps]`` window edge per layer and step from ``window.{step,layer,position}``, None without any.

    A step with no recorded edge keeps the previous step's (the window only moves forward).
    """
    if "window.step" not in arrays or not len(arrays["window.step"]):
        return None
    step = np.asarray(arrays["window.step"], dtype=np.int64)
    layer = np.asarray(arrays["window.layer"], dtype=np.int64)
    edge = np.clip(np.asarray(arrays["window.position"], dtype=np.int64), 0, positions)
    inside = (layer >= 0) & (layer < num_layers) & (step >= 0) & (step < steps)
    edges = np.zeros((num_layers, steps), dtype=np.int64)
    np.maximum.at(edges, (layer[inside], step[inside]), edge[inside])
    return np.maximum.accumulate(edges, axis=1)
