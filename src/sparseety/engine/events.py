"""Columnar logs of token lifecycle events, kept as tensors while running and as NumPy arrays after."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

EVICTED = "evicted"
SKIPPED = "skipped"
ATTENDED = "attended"
WINDOW = "window"  #: sliding-window edges: ``position`` is the first position the step's newest query still saw


@dataclass
class EventLog:
    """Events of one kind, appended one ``[b, kv_heads, e]`` block at a time (batch 0 is kept)."""

    kind: str
    all_heads: bool = False  #: one row per (step, layer) for every KV head at once: ``kv_head`` -1
    _steps: list[int] = field(default_factory=list)
    _layers: list[int] = field(default_factory=list)
    _positions: list[torch.Tensor] = field(default_factory=list)
    _scores: list[torch.Tensor] = field(default_factory=list)
    _heads: list[torch.Tensor | None] = field(default_factory=list)

    def add(self, step: int, layer: int, positions: torch.Tensor, scores: torch.Tensor | None,
            heads: torch.Tensor | None = None) -> None:
        """Record ``positions`` ``[kv_heads, e]`` (with their ``scores``) at ``(step, layer)``; with ``heads``
        ``[e]`` (a layer split per head), ``positions`` is ``[1, e]`` and ``heads`` names each one's KV head."""
        if positions.numel() == 0:
            return
        self._steps.append(step)
        self._layers.append(layer)
        self._heads.append(None if heads is None else heads.detach().reshape(-1))
        self._positions.append(positions.detach())
        self._scores.append(
            torch.full(positions.shape, float("nan")) if scores is None else scores.detach().float()
        )

    def __len__(self) -> int:
        return sum(p.numel() for p in self._positions)

    def to_arrays(self, token_ids: np.ndarray) -> dict[str, np.ndarray]:
        """One row per (step, layer, kv_head, position): columns step, layer, kv_head, position, token_id, score."""
        if not self._positions:
            empty = np.zeros(0, dtype=np.int64)
            return {"step": empty, "layer": empty, "kv_head": empty, "position": empty,
                    "token_id": empty, "score": np.zeros(0, dtype=np.float32)}
        steps, layers, heads, positions, scores = [], [], [], [], []
        for step, layer, pos, score, head in zip(self._steps, self._layers, self._positions, self._scores, self._heads):
            kvh, e = pos.shape
            steps.append(np.full(kvh * e, step, dtype=np.int64))
            layers.append(np.full(kvh * e, layer, dtype=np.int64))
            if self.all_heads:
                heads.append(np.full(kvh * e, -1, dtype=np.int64))
            elif head is not None:
                heads.append(head.cpu().numpy().astype(np.int64))
            else:
                heads.append(np.repeat(np.arange(kvh, dtype=np.int64), e))
            positions.append(pos.reshape(-1).cpu().numpy().astype(np.int64))
            scores.append(score.reshape(-1).cpu().numpy().astype(np.float32))
        position = np.concatenate(positions)
        return {
            "step": np.concatenate(steps),
            "layer": np.concatenate(layers),
            "kv_head": np.concatenate(heads),
            "position": position,
            "token_id": token_ids[position],
            "score": np.concatenate(scores),
        }

    def distinct_positions(self) -> int:
        """Distinct token positions with at least one event."""
        if not self._positions:
            return 0
        return int(torch.cat([p.reshape(-1) for p in self._positions]).unique().numel())
