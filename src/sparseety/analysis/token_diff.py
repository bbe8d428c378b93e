"""Token diff between a baseline and a sparse output: difflib's SequenceMatcher on token ids."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DiffOp:
    """One opcode: ``baseline[b0:b1]`` becomes ``sparse[s0:s1]`` (tag equal, replace, delete or insert)."""

    tag: str
    baseline_start: int
    baseline_end: int
    sparse_start: int
    sparse_end: int
    baseline_ids: list[int]
    sparse_ids: list[int]
    baseline_tokens: list[str]
    sparse_tokens: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tag": self.tag, "baseline_tokens": self.baseline_tokens, "sparse_tokens": self.sparse_tokens,
            "baseline_ids": self.baseline_ids, "sparse_ids": self.sparse_ids,
            "baseline_span": [self.baseline_start, self.baseline_end],
            "sparse_span": [self.sparse_start, self.sparse_end],
        }


@dataclass(frozen=True)
class TokenDiff:
    """``ratio``: SequenceMatcher's similarity in [0, 1]; ``first_divergence``: the first generation step
    whose tokens differ (the shorter length when one output is a prefix of the other), None when equal."""

    ratio: float
    first_divergence: int | None
    ops: list[DiffOp]

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "first_divergence": self.first_divergence,
                "ops": [op.to_dict() for op in self.ops]}


def first_divergence(baseline: Sequence[int], sparse: Sequence[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    for i, (a, b) in enumerate(zip(baseline, sparse)):
        if a != b:
            return i
    return None if len(baseline) == len(sparse) else min(len(baseline), len(sparse))


def token_diff(baseline: Sequence[int], sparse: Sequence[int], decode: Callable[[int], str] = str) -> TokenDiff:
    """Diff two token id sequences.

    Parameters
    ----------
    baseline, sparse : generated token ids ``[n_baseline]``, ``[n_sparse]``.
    decode : text of one token id, for the opcodes' ``*_tokens``.
    """
    a, b = list(map(int, baseline)), list(map(int, sparse))
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    ops = [
        DiffOp(tag, i1, i2, j1, j2, a[i1:i2], b[j1:j2], [decode(t) for t in a[i1:i2]], [decode(t) for t in b[j1:j2]])
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
    ]
    ratio = matcher.ratio() if (a or b) else 1.0
    return TokenDiff(ratio=ratio, first_divergence=first_divergence(a, b), ops=ops)


def apply_ops(baseline: Sequence[int], ops: Sequence[DiffOp]) -> list[int]:
    """Rebuild the sparse sequence from the baseline and the opcodes (the inverse the diff promises)."""
    out: list[int] = []
    for op in ops:
        if op.tag == "equal":
            out.extend(baseline[op.baseline_start:op.baseline_end])
        elif op.tag in ("replace", "insert"):
            out.extend(op.sparse_ids)
    return out
