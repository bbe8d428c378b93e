"""Bias of a policy: which kinds of tokens and which parts of the sequence it keeps, against a uniform policy.

From a stored trace (tier >= 2: the final kept positions of every layer and KV head, and the token
texts), every fed position is put in a token class and a position bucket; a class's retained fraction
is its kept (layer, kv_head, position) slots over all of its slots, and a uniform policy would retain
every class at the overall kept fraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sparseety.errors import RecordError
from sparseety.token_classes import TOKEN_CLASSES, token_class

if TYPE_CHECKING:
    from sparseety.store import StoredTrace

POSITION_BUCKETS = ("sinks", "early", "middle", "recent")
SINKS = 4


def position_bucket(position: int, seen: int) -> str:
    """``sinks`` (the first 4 positions), then thirds of the rest: ``early``, ``middle``, ``recent``."""
    if position < SINKS:
        return "sinks"
    third = (position - SINKS) * 3 // max(1, seen - SINKS)
    return POSITION_BUCKETS[1 + min(third, 2)]


@dataclass(frozen=True)
class BiasRow:
    """``kept`` of ``total`` (layer, kv_head, position) slots; ``expected`` = what a uniform policy keeps."""

    name: str
    positions: int
    kept: int
    total: int
    expected: float

    @property
    def retained_fraction(self) -> float | None:
        return self.kept / self.total if self.total else None

    def to_dict(self, overall: float) -> dict[str, Any]:
        fraction = self.retained_fraction
        return {"positions": self.positions, "kept": self.kept, "total": self.total,
                "retained_fraction": fraction, "expected_kept": self.expected, "uniform_fraction": overall,
                "lift": None if fraction is None or overall == 0 else fraction / overall}


@dataclass
class BiasReport:
    """Retained fractions by token class and by position bucket for one run."""

    request_id: str
    policy: str
    budget: int | None
    seen: int
    slots_kept: int
    slots_total: int
    by_class: list[BiasRow]
    by_position: list[BiasRow]

    @property
    def kept_fraction(self) -> float:
        return self.slots_kept / self.slots_total if self.slots_total else 0.0

    def to_json(self) -> dict[str, Any]:
        overall = self.kept_fraction
        return {"kind": "bias", "request_id": self.request_id, "policy": self.policy, "budget": self.budget,
                "positions": self.seen, "slots_kept": self.slots_kept, "slots_total": self.slots_total,
                "kept_fraction": overall,
                "by_class": {r.name: r.to_dict(overall) for r in self.by_class},
                "by_position": {r.name: r.to_dict(overall) for r in self.by_position}}


def _rows(labels: np.ndarray, names: tuple[str, ...], kept_counts: np.ndarray, heads: int,
          overall: float) -> list[BiasRow]:
    positions = np.bincount(labels, minlength=len(names))
    return [BiasRow(name, int(positions[i]), int(kept_counts[i]), int(positions[i]) * heads,
                    float(positions[i] * heads * overall)) for i, name in enumerate(names)]


def bias_report(trace: StoredTrace) -> BiasReport:
    """Retained fraction by token class and position bucket of the run in ``trace``.

    Raises :class:`RecordError` when the trace lacks the data (tier < 2, or ids-only without texts).
    """
    doc = trace.document
    kept = (doc.get("sparsity") or {}).get("kept_positions_final")
    if not kept:
        raise RecordError(f"trace {trace.request_id} is tier {trace.tier}; bias analysis needs tier >= 2 "
                          "(kept positions per layer and KV head): rerun with --tier 2")
    texts = doc.get("token_texts") or []
    if not texts:
        raise RecordError(f"trace {trace.request_id} has no token texts (written ids-only); bias analysis "
                          "needs tier >= 2 with token texts")
    special_ids = set((doc.get("provenance") or {}).get("special_token_ids") or [])
    token_ids = list(doc.get("prompt_token_ids") or []) + list(doc.get("output_token_ids") or [])
    lists = [np.asarray(p, dtype=np.int64) for heads in kept.values() for p in heads.values()]
    evicted = trace.arrays.get("evicted.position", np.zeros(0, dtype=np.int64))
    seen = int(max([int(x.max()) for x in lists if x.size] + [int(evicted.max()) if evicted.size else -1])) + 1
    if seen > len(texts):
        raise RecordError(f"trace {trace.request_id} holds {len(texts)} token texts but positions up to {seen - 1}")
    classes = np.asarray([TOKEN_CLASSES.index(token_class(texts[p], p < len(token_ids) and token_ids[p] in special_ids))
                          for p in range(seen)], dtype=np.int64)
    buckets = np.asarray([POSITION_BUCKETS.index(position_bucket(p, seen)) for p in range(seen)], dtype=np.int64)
    all_kept = np.concatenate(lists) if lists else np.zeros(0, dtype=np.int64)
    heads = len(lists)
    slots_total = seen * heads
    overall = all_kept.size / slots_total if slots_total else 0.0
    return BiasReport(
        request_id=trace.request_id,
        policy=str((doc.get("sparsity") or {}).get("policy")),
        budget=(doc.get("sparsity") or {}).get("budget"),
        seen=seen, slots_kept=int(all_kept.size), slots_total=slots_total,
        by_class=_rows(classes, TOKEN_CLASSES, np.bincount(classes[all_kept], minlength=len(TOKEN_CLASSES)), heads, overall),
        by_position=_rows(buckets, POSITION_BUCKETS, np.bincount(buckets[all_kept], minlength=len(POSITION_BUCKETS)),
                          heads, overall),
    )
