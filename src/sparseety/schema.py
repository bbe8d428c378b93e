"""The data model every component shares: :class:`TokenRecord` and ``SCHEMA_VERSION``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sparseety.errors import RecordError

SCHEMA_VERSION = "1.0"

TokenType = Literal["prompt", "generated", "special"]
TOKEN_TYPES: tuple[str, ...] = ("prompt", "generated", "special")
"""``prompt``: a position before the prompt length; ``generated``: a position at or after it;
``special``: a special-token id (BOS, EOS, chat-template markers) wherever it stands."""


@dataclass(slots=True)
class TokenRecord:
    """One token the system treated as important, with its rank in one ranking.

    Attributes
    ----------
    token_id : vocabulary id of the token.
    position : index in ``prompt_tokens + generated_tokens``.
    score : the token's score after reduction and normalization.
    layer : model layer the signal came from, or None.
    step : decode step the signal came from, or None (prefill, or unknown).
    head : attention head of a per-head ranking, or None when heads were reduced.
    rank : 0 for the most important token of its ranking, then 1, 2, ... with scores non-increasing.
    token_type : one of :data:`TOKEN_TYPES`.
    text : decoded text of the token, or None (no decoder, or decoding failed).
    experts : for route signals, the token's top experts as ``[expert_id, prob]`` pairs; else None.
    """

    token_id: int
    position: int
    score: float
    layer: int | None
    step: int | None
    head: int | None
    rank: int
    token_type: TokenType
    text: str | None = None
    experts: list[list[int | float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; ``experts`` is present only for route records."""
        out: dict[str, Any] = {
            "token_id": self.token_id,
            "position": self.position,
            "score": self.score,
            "layer": self.layer,
            "step": self.step,
            "head": self.head,
            "rank": self.rank,
            "token_type": self.token_type,
            "text": self.text,
        }
        if self.experts is not None:
            out["experts"] = [list(pair) for pair in self.experts]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenRecord:
        """Inverse of :meth:`to_dict`; raises :class:`RecordError` naming a missing or mistyped key.

        ``token_id``, ``position``, ``score``, ``rank`` and ``token_type`` are required; ``layer``,
        ``step``, ``head``, ``text`` and ``experts`` may be absent (None).
        """
        if not isinstance(data, Mapping):
            raise RecordError(f"a token record must be a JSON object, got {type(data).__name__}")
        token_type = _field(data, "token_type", str)
        if token_type not in TOKEN_TYPES:
            raise RecordError(f"token record key 'token_type' must be one of {TOKEN_TYPES}, got {token_type!r}")
        return cls(
            token_id=_field(data, "token_id", int),
            position=_field(data, "position", int),
            score=float(_field(data, "score", float)),
            layer=_field(data, "layer", int, optional=True),
            step=_field(data, "step", int, optional=True),
            head=_field(data, "head", int, optional=True),
            rank=_field(data, "rank", int),
            token_type=token_type,
            text=_field(data, "text", str, optional=True),
            experts=_experts(data.get("experts")),
        )


def _field(data: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    """``data[key]`` checked against ``kind`` (int excludes bool; float accepts int)."""
    if key not in data or data[key] is None:
        if optional:
            return None
        raise RecordError(f"token record is missing the key {key!r}")
    value = data[key]
    accepted = (int, float) if kind is float else kind
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise RecordError(f"token record key {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _experts(value: Any) -> list[list[int | float]] | None:
    if value is None:
        return None
    message = "token record key 'experts' must be a list of [expert_id, prob] pairs"
    if not isinstance(value, list):
        raise RecordError(message)
    pairs: list[list[int | float]] = []
    for pair in value:
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or isinstance(pair[0], bool)
            or not isinstance(pair[0], int)
            or isinstance(pair[1], bool)
            or not isinstance(pair[1], (int, float))
        ):
            raise RecordError(f"{message}, got {pair!r}")
        pairs.append([pair[0], float(pair[1])])
    return pairs


SPARSITY_FIELDS = ("policy", "params", "budget", "evicted_positions", "eviction_events", "skipped_events",
                   "kept_positions_final", "kv_cache_bytes_peak", "kv_cache_bytes_dense", "draft_tokens",
                   "draft_rejected", "pruned_tokens", "prune")


def sparsity_json(run: Any) -> dict[str, Any]:
    """The ``sparsity`` block of a run's JSON record, the same keys for every engine (the own engine's
    :class:`~sparseety.engine.result.RunResult`, vLLM's :class:`~sparseety.integrations.vllm.transport.record.VllmRun`): each
    of :data:`SPARSITY_FIELDS` read from ``run``, None where that engine has no such field (vLLM prunes nothing)."""
    return {name: getattr(run, name, None) for name in SPARSITY_FIELDS}
