"""``dense``: the baseline. Nothing is evicted; the model computes exactly what plain generation computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.policies.base import Observation, Policy


@dataclass
class DensePolicy(Policy):
    """Keep every token. ``budget`` is ignored."""

    name: ClassVar[str] = "dense"
    summary: ClassVar[str] = "nothing evicted (the baseline)"
    evicts: ClassVar[bool] = False

    def layer_budget(self, layer: int, num_layers: int, seen: int | None = None) -> int | None:
        return None

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.full(obs.positions.shape, float("inf")), None
