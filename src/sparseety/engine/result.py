"""``RunResult``: everything one traced generation produced, and its ``--json`` form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparseety.schema import TokenRecord, sparsity_json


@dataclass
class RunResult:
    """The outcome of :meth:`SparseEngine.generate`.

    Array attributes index the full sequence (prompt then generated tokens) by ``position``.
    """

    request_id: str
    model: str
    text: str
    prompt_ids: list[int]
    output_ids: list[int]
    policy: str
    params: dict[str, Any]
    budget: int | None
    tier: int
    evicted_positions: int | None
    eviction_events: int | None
    skipped_events: int | None
    kept_positions_final: dict[str, dict[str, list[int]]] | None
    kv_cache_bytes_peak: int
    kv_cache_bytes_dense: int
    draft_tokens: int
    draft_rejected: int
    prefill_s: float
    decode_s: float
    important_tokens: list[TokenRecord] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  #: tier >= 2: text of each position's token
    provenance: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    trace_path: str | None = None
    pruned_tokens: int | None = None  #: distinct prompt positions dropped by token pruning (tier >= 1)
    prune: dict[str, Any] | None = None  #: the pruning schedule and options, None without pruning
    layer_selection: str = "all"  #: ``--layers`` as given: all, auto or a list
    extraction_layers: list[int] | None = None  #: layers that recorded importance (tier >= 2)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated token ids: the sequence every ``position`` indexes."""
        return self.prompt_ids + self.output_ids

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens after the first, per second of decoding."""
        n = len(self.output_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None

    def kept_per_layer(self) -> list[tuple[int, int, int]]:
        """``(layer, kept slots summed over KV heads, evicted events)`` per layer."""
        kept = self.kept_positions_final or {}
        evicted = np.bincount(self.arrays["evicted.layer"], minlength=len(kept)) if "evicted.layer" in self.arrays else None
        rows = []
        for layer, heads in kept.items():
            n_evicted = int(evicted[int(layer)]) if evicted is not None and int(layer) < len(evicted) else 0
            rows.append((int(layer), sum(len(p) for p in heads.values()), n_evicted))
        return rows

    def to_json(self) -> dict[str, Any]:
        """The ``sparseety run --json`` object."""
        prompt_tokens = len(self.prompt_ids)
        completion_tokens = len(self.output_ids)
        return {
            "request_id": self.request_id,
            "model": self.model,
            "tier": self.tier,
            "text": self.text,
            "output_token_ids": self.output_ids,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "sparsity": sparsity_json(self),
            "extraction": {"layers": self.layer_selection, "recorded_layers": self.extraction_layers},
            "important_tokens": [r.to_dict() for r in self.important_tokens],
            "timings": {
                "prefill_s": round(self.prefill_s, 6),
                "decode_s": round(self.decode_s, 6),
                "decode_tokens_per_s": self.decode_tokens_per_s,
            },
            "trace_path": self.trace_path,
        }
