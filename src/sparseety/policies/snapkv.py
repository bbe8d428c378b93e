"""``snapkv``: SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparseety.policies.base import (
    Observation,
    Policy,
    Signal,
    accumulated,
    check_positive_int,
    protect,
    recent_mask,
)
from sparseety.policies.parts.value_aware import check_value_aware, value_weighted


def window_vote(attention: torch.Tensor, kernel: int) -> torch.Tensor:
    """Observation-window vote, pooled along the key axis.

    Parameters
    ----------
    attention : ``[b, kv_heads, w, n]`` probabilities of the last ``w`` query rows.
    kernel : 1-D average-pooling width (odd).

    Returns
    -------
    ``[b, kv_heads, n]`` scores; the window's own slots get ``+inf`` later, via :func:`recent_mask`.
    """
    votes = attention.sum(dim=-2)
    b, h, n = votes.shape
    if kernel > 1:
        pooled = F.avg_pool1d(votes.reshape(b * h, 1, n), kernel, stride=1, padding=kernel // 2,
                              count_include_pad=False)
        votes = pooled.reshape(b, h, -1)[..., :n]
    return votes


@dataclass
class SnapKVPolicy(Policy):
    """At the end of prefill the last ``window`` query rows vote; votes are pooled (``kernel``); top budget kept per KV head.

    The window itself is always kept. While decoding, the budget is still enforced: each step's
    attention row is added to the vote (as H2O accumulates), and the newest ``window`` positions stay.
    ``value_aware=true`` (VATP) multiplies the pooled vote by each slot's ``‖v‖₁`` and keeps the first 4
    positions (:mod:`sparseety.policies.parts.value_aware`).
    """

    name: ClassVar[str] = "snapkv"
    summary: ClassVar[str] = "observation-window vote at prefill, pooled (SnapKV)"
    prefill_signal: ClassVar[Signal] = Signal.WINDOW
    decode_signal: ClassVar[Signal] = Signal.LAST_ROW

    window: int = 32
    kernel: int = 5
    value_aware: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(self.name, "window", self.window)
        check_positive_int(self.name, "kernel", self.kernel)
        check_value_aware(self.name, self.value_aware)

    def window_rows(self) -> int:
        return self.window

    def stacks_decode(self) -> bool:
        return not self.value_aware  # VATP reads each layer's values

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert obs.attention is not None
        if obs.attention.dim() == 4:
            state = window_vote(obs.attention, self.kernel)
        else:
            state = accumulated(obs)
        budget = self.layer_budget(obs.layer, obs.num_layers) or 0  # the compressing regime's budget
        scores = value_weighted(state, obs) if self.value_aware else state
        return protect(scores, recent_mask(obs.positions, min(self.window, budget), obs.newest)), state
