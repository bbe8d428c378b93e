"""``streaming``: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.policies.base import BudgetTooSmall, Observation, Policy, check_positive_int, protect


@dataclass
class StreamingPolicy(Policy):
    """Keep the first ``sinks`` tokens plus the most recent ``budget - sinks`` tokens.

    Score of a slot is its position (newer is better); sink slots score ``+inf``. The kept set is
    therefore exactly the sinks plus the newest positions, in every layer and head.
    """

    name: ClassVar[str] = "streaming"
    reads_keys: ClassVar[bool] = False
    summary: ClassVar[str] = "attention sinks + recent window (StreamingLLM)"

    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(self.name, "sinks", self.sinks, minimum=0)
        if self.budget is not None and self.budget < self.sinks:
            raise BudgetTooSmall(f"streaming: budget ({self.budget}) must be >= sinks ({self.sinks})", self.sinks,
                                 f"its {self.sinks} sinks")

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = obs.positions
        return protect(positions.to(torch.float32), positions < self.sinks), None

    def stacks_decode(self) -> bool:
        return True

    def evict_one(self, positions: torch.Tensor, seen: int) -> torch.Tensor | None:
        """The oldest slot past the sinks (positions are distinct per head, and exact as float32 scores below 2**24)."""
        if seen > 2**24:
            return None
        return positions.masked_fill(positions < self.sinks, seen).argmin(dim=-1, keepdim=True)
