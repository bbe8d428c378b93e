"""``tova``: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.errors import ConfigError
from sparseety.policies.base import Observation, Policy, Signal
from sparseety.policies.parts.value_aware import check_value_aware, protect_sinks, value_norms

HEAD_MODES = ("layer", "kv_head")


@dataclass
class TOVAPolicy(Policy):
    """Every step, evict the slots with the lowest attention from the current query.

    The score is the current (last) query row's attention; at prefill the last prompt token's row
    decides. ``heads="layer"`` (the paper's choice, and kvpress's) averages it over every head of the
    layer, so all KV heads keep one shared set; ``heads="kv_head"`` averages only over each KV group's
    query heads, so every KV head keeps its own set. ``value_aware=true`` (VATP) multiplies each KV
    head's attention by its slots' ``‖v‖₁`` before the mean over heads, and keeps the first 4 positions
    (:mod:`sparseety.policies.parts.value_aware`).
    """

    name: ClassVar[str] = "tova"
    summary: ClassVar[str] = "lowest attention from the current query is evicted (TOVA)"
    prefill_signal: ClassVar[Signal] = Signal.LAST_ROW
    decode_signal: ClassVar[Signal] = Signal.LAST_ROW
    heads: str = "layer"
    value_aware: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heads not in HEAD_MODES:
            raise ConfigError(f"tova: heads must be one of {', '.join(HEAD_MODES)}, got {self.heads!r}")
        check_value_aware(self.name, self.value_aware)

    def stacks_decode(self) -> bool:
        return not self.value_aware  # VATP reads each layer's values

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, kv_heads, n]`` attention of the current query (slots of every KV head are aligned in
        ``layer`` mode, since every head has kept the same positions)."""
        assert obs.attention is not None
        scores = obs.attention * value_norms(obs) if self.value_aware else obs.attention
        if self.heads == "layer":
            scores = scores.mean(dim=1, keepdim=True).expand_as(scores)
        return (protect_sinks(scores, obs.positions) if self.value_aware else scores), None
