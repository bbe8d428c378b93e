"""``ReconstructionState``: a reconstructing policy's pass in progress (kvzip), the run context's part of it.

The forward that completes a region under such a policy defers its eviction (``pending``); the engine
then feeds the policy's :class:`~sparseety.policies.base.ReconstructionChunk` s (:mod:`.reconstruct`),
each layer adding its scores of the region's slots here; at the end every layer evicts by them.
Shapes: ``b`` sequences, ``kv_heads`` KV heads, ``region`` positions scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseety.engine.cache import SparseCache
from sparseety.policies.base import ReconstructionChunk


@dataclass
class ReconstructionState:
    """Where a reconstructing policy's pass stands for one sequence (idle for every other policy)."""

    pending: bool = False  #: the region is prefilled; the engine must run its reconstruction next
    region: int = 0  #: positions ``0 .. region - 1`` the reconstruction scores
    chunk: ReconstructionChunk | None = None  #: the reconstruction forward in progress, if any
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  #: per global layer ``[b, kv_heads, region]``

    def open(self, cache: SparseCache) -> None:
        """Before the first chunk: check every global layer holds the region's slots in position order,
        nothing evicted, and give it zero scores (a sliding layer holds only its window: scored by recency)."""
        if self.scores:
            return
        for layer, cache_layer in enumerate(cache.layers):
            positions = cache_layer.positions
            assert positions is not None
            if cache_layer.window is not None:
                continue
            expected = torch.arange(self.region, device=positions.device)
            if positions.shape[-1] != self.region or not bool((positions == expected).all()):
                raise RuntimeError("reconstruction needs the region's slots, in position order, nothing evicted")
            self.scores[layer] = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)

    def take(self, layer: int, scores: torch.Tensor | None) -> None:
        """Layer ``layer``'s scores ``[b, kv_heads, chunk]`` of the current chunk's slots (None: a sliding layer)."""
        chunk = self.chunk
        assert chunk is not None
        if scores is not None:
            self.scores[layer][..., chunk.start : chunk.end] = scores
