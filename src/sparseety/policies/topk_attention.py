"""``topk_attention``: non-evicting top-k attention while decoding (as in Quest / top-k sparse attention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.policies.base import Observation, Policy


@dataclass
class TopKAttentionPolicy(Policy):
    """Each decode step attends only to the ``budget`` keys with the largest ``q·k`` per KV head.

    Logits are summed over the query heads of the group before the top-k. Nothing is deleted; the
    skipped keys are recorded per step. Prefill is dense.
    """

    name: ClassVar[str] = "topk_attention"
    summary: ClassVar[str] = "decode attends only to the top-k keys by q·k (non-evicting)"
    evicts: ClassVar[bool] = False
    attends_topk: ClassVar[bool] = True

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.full(obs.positions.shape, float("inf")), None
