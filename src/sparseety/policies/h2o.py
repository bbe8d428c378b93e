"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.errors import ConfigError
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


@dataclass
class H2OPolicy(Policy):
    """Keep the heavy hitters by accumulated attention plus a recent window; evicts while decoding.

    The accumulated score of a slot is the attention it received from every query so far: the
    column sums of the prefill attention (computed block by block), then each decode step's row,
    averaged over the query heads of the KV group. The newest ``int(budget * recent_ratio)``
    positions are always kept.

    Exact prefill column sums cost two to four flash-attention passes on CPU, so a long prefill
    estimates them from at most ``prefill_rows`` query rows spread evenly (every ``ceil(q /
    prefill_rows)``-th row counting back from the last, sums scaled by that stride). Prompts up to
    ``prefill_rows`` tokens, or ``prefill_rows=0``, get the exact H2O score.

    ``value_aware=true`` is H2O w/ VATP: the accumulated score times each slot's ``‖v‖₁``, and the first
    4 positions kept (:mod:`sparseety.policies.parts.value_aware`).
    """

    name: ClassVar[str] = "h2o"
    summary: ClassVar[str] = "heavy hitters by accumulated attention + recent window"
    prefill_signal: ClassVar[Signal] = Signal.COLSUM
    decode_signal: ClassVar[Signal] = Signal.LAST_ROW

    recent_ratio: float = 0.5
    prefill_rows: int = 512
    value_aware: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.recent_ratio, (int, float)) or not 0.0 <= self.recent_ratio < 1.0:
            raise ConfigError(f"h2o: recent_ratio must be in [0, 1), got {self.recent_ratio!r}")
        check_positive_int(self.name, "prefill_rows", self.prefill_rows, minimum=0)
        check_value_aware(self.name, self.value_aware)

    def colsum_stride(self, q_len: int) -> int:
        return 1 if self.prefill_rows == 0 else max(1, -(-q_len // self.prefill_rows))

    def stacks_decode(self) -> bool:
        return not self.value_aware  # VATP reads each layer's values

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        state = accumulated(obs)
        window = int((self.budget or 0) * self.recent_ratio)
        scores = value_weighted(state, obs) if self.value_aware else state
        return protect(scores, recent_mask(obs.positions, window, obs.newest)), state
