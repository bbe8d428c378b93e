"""``knorm``: key-norm eviction (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.policies.base import Observation, Policy


@dataclass
class KnormPolicy(Policy):
    """Keep the keys with the lowest L2 norm (low-norm keys draw high attention); score ``-||k||``."""

    name: ClassVar[str] = "knorm"
    summary: ClassVar[str] = "low key-norm kept (L2 norm)"

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        return -obs.keys.float().norm(dim=-1), None
