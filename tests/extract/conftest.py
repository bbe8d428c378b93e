"""An independent, deliberately naive reference extractor (plain Python loops over nested lists).

It re-implements the issue's semantics from scratch so the vectorized extractor can be checked
against it: query rows fold first, then heads; then normalization; then ``min_score`` and ``top_k``
with ties to the lower position.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

DEFAULT_LAYOUTS = {4: "bhqk", 3: "hqk", 2: "qk"}


def naive_extract(
    token_ids: list[int],
    scores: Any,
    cfg: dict[str, Any],
    prompt_len: int | None = None,
    layer: int | None = None,
) -> tuple[list[dict[str, Any]], list[int] | None]:
    """Reference: ``(records as dicts, expert load or None)``; ``cfg`` holds the non-default settings."""
    c = {
        "score_type": "attention",
        "layout": None,
        "batch_index": None,
        "head_reduce": "mean",
        "query_reduce": "sum",
        "route_input": "probs",
        "experts_k": 2,
        "activation_reduce": "maxabs",
        "zero_eps": 1e-6,
        "normalize": "max",
        "top_k": 16,
        "min_score": 0.05,
        "token_offset": 0,
        "exclude_special": False,
        "special_ids": (),
    } | cfg
    x = np.asarray(scores, dtype=np.float64)
    total = len(token_ids)
    prompt_len = total if prompt_len is None else prompt_len
    experts: list[list[list[float]]] | None = None
    load = None
    if c["score_type"] == "attention":
        rows = _naive_attention(x.tolist(), x.ndim, c)
    else:
        data = x.tolist()
        if x.ndim == 3:
            data = data[c["batch_index"] or 0]
        if c["score_type"] == "activation":
            rows = [[_naive_activation(vec, c) for vec in data]]
        else:
            probs = [_softmax(vec) if c["route_input"] == "logits" else vec for vec in data]
            ranked = [sorted(range(len(p)), key=lambda e, p=p: (-p[e], e))[: c["experts_k"]] for p in probs]
            experts = [[[e, p[e]] for e in order] for order, p in zip(ranked, probs)]
            load = [sum(e in order for order in ranked) for e in range(len(probs[0]))]
            rows = [[p[order[0]] for p, order in zip(probs, ranked)]]
    offset = c["token_offset"]
    n = len(rows[0])
    assert n + offset in (total, prompt_len), "the reference only handles aligned inputs"
    special = set(c["special_ids"])
    excluded = [c["exclude_special"] and token_ids[j + offset] in special for j in range(n)]
    records = []
    for head, row in enumerate(rows):
        row = [0.0 if excluded[j] else v for j, v in enumerate(row)]
        row = _naive_normalize(row, c["normalize"])
        candidates = [(v, j) for j, v in enumerate(row) if not excluded[j] and v >= c["min_score"]]
        candidates.sort(key=lambda pair: (-pair[0], pair[1]))
        for rank, (value, j) in enumerate(candidates[: c["top_k"]]):
            position = j + offset
            token_id = token_ids[position]
            record = {
                "token_id": token_id,
                "position": position,
                "score": value,
                "layer": layer,
                "head": head if c["score_type"] == "attention" and c["head_reduce"] == "none" else None,
                "rank": rank,
                "token_type": "special" if token_id in special else "prompt" if position < prompt_len else "generated",
            }
            if experts is not None:
                record["experts"] = experts[j]
            records.append(record)
    return records, load


def _naive_attention(x: list, ndim: int, c: dict[str, Any]) -> list[list[float]]:
    layout = c["layout"] or DEFAULT_LAYOUTS[ndim]
    sizes = {axis: 1 for axis in "bhqk"}
    probe = x
    for axis in layout:
        sizes[axis] = len(probe)
        probe = probe[0]

    def at(b: int, h: int, q: int, k: int) -> float:
        value = x
        for axis in layout:
            value = value[{"b": b, "h": h, "q": q, "k": k}[axis]]
        return value

    b = c["batch_index"] or 0
    per_head = []
    for h in range(sizes["h"]):
        row = []
        for k in range(sizes["k"]):
            column = [at(b, h, q, k) for q in range(sizes["q"])]
            fold = c["query_reduce"]
            row.append(
                sum(column)
                if fold == "sum"
                else sum(column) / len(column)
                if fold == "mean"
                else max(column)
                if fold == "max"
                else column[-1]
            )
        per_head.append(row)
    if c["head_reduce"] == "none":
        return per_head
    columns = list(zip(*per_head))
    if c["head_reduce"] == "mean":
        return [[sum(col) / len(col) for col in columns]]
    return [[max(col) for col in columns]]


def _naive_activation(vec: list[float], c: dict[str, Any]) -> float:
    if c["activation_reduce"] == "maxabs":
        return max(abs(v) for v in vec)
    if c["activation_reduce"] == "l2":
        return math.sqrt(sum(v * v for v in vec))
    return sum(abs(v) > c["zero_eps"] for v in vec) / len(vec)


def _softmax(vec: list[float]) -> list[float]:
    top = max(vec)
    exps = [math.exp(v - top) for v in vec]
    return [e / sum(exps) for e in exps]


def _naive_normalize(row: list[float], how: str) -> list[float]:
    if how == "none":
        return row
    if how == "max":
        norm = max(abs(v) for v in row)
    elif how == "l1":
        norm = sum(abs(v) for v in row)
    else:
        norm = math.sqrt(sum(v * v for v in row))
    return row if norm == 0 else [v / norm for v in row]


def assert_same_records(actual: list, expected: list[dict[str, Any]], rel: float = 1e-9) -> None:
    """Identity fields equal exactly; scores (and expert probabilities) equal to ``rel``."""
    got = [r.to_dict() for r in actual]
    assert [_identity(r) for r in got] == [_identity(r) for r in expected]
    assert [r["score"] for r in got] == pytest.approx([r["score"] for r in expected], rel=rel, abs=1e-12)
    for g, e in zip(got, expected):
        if "experts" in e:
            assert [pair[0] for pair in g["experts"]] == [pair[0] for pair in e["experts"]]
            assert [pair[1] for pair in g["experts"]] == pytest.approx([pair[1] for pair in e["experts"]], rel=rel)


def _identity(record: dict[str, Any]) -> tuple:
    keys = ("token_id", "position", "layer", "head", "rank", "token_type")
    return tuple(record[key] for key in keys) + ("experts" in record,)


@pytest.fixture(scope="session")
def reference():
    """The naive reference: ``reference(token_ids, scores, cfg_dict, prompt_len=None, layer=None)``."""
    return naive_extract


@pytest.fixture(scope="session")
def same_records():
    """``same_records(actual_records, reference_records)`` asserts they match."""
    return assert_same_records
