"""The ``value_aware`` option of ``h2o``, ``tova`` and ``snapkv``: VATP's value-aware token importance.

VATP (Guo et al., 2024, "Attention Score is not All You Need for Token Importance Indicator in KV Cache
Reduction: Value Also Matters", arXiv 2406.12335) scores a slot by its attention score times the ℓ1 norm of
its value vector, ``score_j · ‖v_j‖₁``: a slot that takes much attention but carries a small value (an
attention sink) adds little to the output. Because a slot's value never changes, weighting the accumulated
score once per scoring equals VATP's per-step weighted sum. VATP then always keeps the first ``sink_len``
tokens (20 for its 4k-token prompts); here the first :data:`VALUE_SINKS` positions, StreamingLLM's count.

The norms are computed from :attr:`Observation.values` at each scoring, O(n·d) per layer and step (the
attention that step already computed costs O(heads·n·d)); the cache's per-slot norms are ℓ2 and exist only
under ``--importance value|output``, so they are not used.
"""

from __future__ import annotations

from typing import Any

import torch

from sparseety.errors import ConfigError
from sparseety.policies.base import Observation

#: the first positions a value-aware policy always keeps (VATP keeps its attention-sink tokens)
VALUE_SINKS = 4


def check_value_aware(policy: str, value: Any) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ConfigError(f"{policy}: value_aware must be true or false, got {value!r}")


def value_norms(obs: Observation) -> torch.Tensor:
    """``[b, kv_heads, n]`` float32 ℓ1 norms of the slots' values."""
    if obs.values is None:
        raise RuntimeError("value_aware scoring needs Observation.values")
    return obs.values.float().abs().sum(dim=-1)


def protect_sinks(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``scores`` with the slots at the first :data:`VALUE_SINKS` positions set to ``+inf``."""
    return scores.masked_fill((positions >= 0) & (positions < VALUE_SINKS), float("inf"))


def value_weighted(scores: torch.Tensor, obs: Observation) -> torch.Tensor:
    """VATP's score: ``scores`` ``[b, kv_heads, n]`` times each slot's ``‖v‖₁``, the sinks protected."""
    return protect_sinks(scores * value_norms(obs), obs.positions)
