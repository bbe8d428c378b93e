"""What one layer computes in one step: the plan the hook point follows and the signals it hands the run context.

Shapes are batch first, query heads second: ``b`` sequences, ``heads`` query heads, ``kv_heads`` KV
heads, ``n`` cache slots, ``w`` query rows, ``d`` head dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseety.extract.scoring import group_mean  # noqa: F401  (the engine's name for it)


@dataclass
class LayerSignals:
    """Attention information one layer computed this step (batch first, query heads second)."""

    last_row: torch.Tensor | None = None  #: ``[b, heads, n]`` probabilities of the newest query
    window: torch.Tensor | None = None  #: ``[b, heads, w, n]`` probabilities of the last ``w`` queries
    colsum: torch.Tensor | None = None  #: ``[b, heads, n]`` attention received, summed over queries
    attended: torch.Tensor | None = None  #: ``[b, kv_heads, n]`` bool, slots the newest top-k row attended to
    skipped: int = 0  #: visible (row, kv_head, slot) triples a top-k step left out
    queries: torch.Tensor | None = None  #: ``[b, heads, w, d]`` the policy's query rows (:meth:`Policy.query_rows`)
    values: torch.Tensor | None = None  #: ``[b, kv_heads, n, d]`` the layer's cached values
    rotary: torch.Tensor | None = None  #: ``[rotary_dim // 2]`` RoPE inverse frequencies, with ``queries``
    reconstruction: torch.Tensor | None = None  #: ``[b, kv_heads, chunk]`` kvzip scores of the chunk's slots (its pass only)
    hidden: torch.Tensor | None = None  #: ``[b, r, hidden_size]`` attention-input hidden states (:attr:`Policy.needs_hidden`)


@dataclass(frozen=True)
class LayerPlan:
    """What the hook point computes for one layer in one step."""

    last_row: bool
    window_rows: int
    colsum_stride: int  #: 0: no column sums; k: every k-th query row (1 is exact)
    topk: int | None
    colsum_last: int = -1  #: with chunked prefill: the row (of this forward) that is the prefill's last row
    query_rows: int = 0  #: the last query rows handed to the policy (:meth:`Policy.query_rows`)
