"""``tova``: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.policies.base import Observation, Policy, Signal


@dataclass
class TOVAPolicy(Policy):
    """Every step, evict the slots with the lowest attention from the current query.

    The score is the current (last) query row's attention, averaged over the heads of the KV group;
    at prefill the last prompt token's row decides.
    """

    name: ClassVar[str] = "tova"
    summary: ClassVar[str] = "lowest attention from the current query is evicted (TOVA)"
    prefill_signal: ClassVar[Signal] = Signal.LAST_ROW
    decode_signal: ClassVar[Signal] = Signal.LAST_ROW

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert obs.attention is not None
        return obs.attention, None
