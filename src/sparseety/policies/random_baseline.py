"""``random``: a seeded random baseline. Any policy worth using must beat it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.policies.base import Observation, Policy


@dataclass
class RandomPolicy(Policy):
    """Evict uniformly at random; the draw depends only on ``(seed, layer, step)``, so runs repeat."""

    name: ClassVar[str] = "random"
    reads_keys: ClassVar[bool] = False
    summary: ClassVar[str] = "seeded random eviction (a baseline)"

    seed: int = 0

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        gen = torch.Generator().manual_seed(hash((self.seed, obs.seed, obs.layer, obs.step)) & 0x7FFFFFFF)
        return torch.rand(obs.positions.shape, generator=gen).to(obs.positions.device), None
