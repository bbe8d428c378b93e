"""``keydiff``: KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.policies.base import Observation, Policy


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """``[b, kv_heads, n]`` minus the cosine similarity of every key to its head's anchor.

    The anchor is the mean of the L2-normalised keys ``[b, kv_heads, n, d]`` of the head (kvpress's
    ``KeyDiffPress``: ``F.normalize`` then ``mean`` over the sequence, then ``-F.cosine_similarity``),
    computed as two GEMVs over the keys plus their norms (three passes; kvpress's form takes five).
    """
    keys = keys.float()
    norms = torch.linalg.vector_norm(keys, dim=-1)  # [b, h, n]
    inverse = 1.0 / norms.clamp_min(1e-12)  # F.normalize's eps
    anchor = (inverse.unsqueeze(-2) @ keys) / keys.shape[-2]  # [b, h, 1, d]: the mean unit key, one GEMV
    dots = (keys @ anchor.transpose(-1, -2)).squeeze(-1)  # [b, h, n]
    anchor_norm = torch.linalg.vector_norm(anchor, dim=-1)  # [b, h, 1]
    return -dots / (norms * anchor_norm).clamp_min(1e-8)  # F.cosine_similarity's eps


@dataclass
class KeyDiffPolicy(Policy):
    """Keep the keys least similar to the mean key: score ``-cos(k, mean_j k_j / ||k_j||)`` per KV head.

    Needs keys only (no attention, so it works with any attention kernel). Every call re-scores
    every held slot against the anchor of the keys the layer holds *now*: at prefill that is
    kvpress's ``KeyDiffPress`` on the whole prompt; while decoding (one slot evicted per step once
    over budget) it is the paper's iterative block-wise eviction with blocks of one token, i.e.
    kvpress's ``DecodingPress(KeyDiffPress)`` compressing at every step. Nothing is protected (the
    paper and kvpress keep no sinks or recent window); ties keep the lower position.
    """

    name: ClassVar[str] = "keydiff"
    summary: ClassVar[str] = "keys least similar (cosine) to the mean key kept (KeyDiff)"

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        return keydiff_scores(obs.keys), None
