"""Bias analysis: token classes and position buckets partition the kept slots; tier checks."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import prompt_ids

from sparseety.analysis.bias import POSITION_BUCKETS, bias_report, position_bucket
from sparseety.engine import EncodedInput
from sparseety.errors import RecordError
from sparseety.policies import build_policy
from sparseety.store import load_trace, write_trace
from sparseety.token_classes import TOKEN_CLASSES, token_class


@pytest.mark.parametrize(("text", "special", "expected"), [
    ("<|im_start|>", False, "special"), ("<bos>", False, "special"), ("hello", True, "special"),
    (" 2024", False, "digits"), ("7", False, "digits"), (",", False, "punctuation"), (" ).", False, "punctuation"),
    ("$", False, "punctuation"), (" the", False, "words"), ("a1", False, "words"), ("\n\n", False, "whitespace"),
    (" ", False, "whitespace"),
])
def test_token_class(text, special, expected):
    assert token_class(text, special) == expected


def test_position_buckets():
    seen = 34  # 4 sinks, then 30 positions in thirds of 10
    labels = [position_bucket(p, seen) for p in range(seen)]
    assert labels == ["sinks"] * 4 + ["early"] * 10 + ["middle"] * 10 + ["recent"] * 10


def _trace(engine, tmp_path, policy, tier):
    result = engine.generate(EncodedInput(prompt_ids(30, seed=3)), policy, max_new_tokens=5, tier=tier)
    write_trace(result, tmp_path)
    return result, load_trace(tmp_path, result.request_id)


def test_buckets_sum_to_the_kept_totals(tiny_engine, one_thread, tmp_path):
    result, trace = _trace(tiny_engine, tmp_path, build_policy("h2o", 12), tier=2)
    report = bias_report(trace).to_json()
    kept = result.kept_positions_final
    lists = [p for heads in kept.values() for p in heads.values()]
    seen = 30 + 5 - 1
    assert report["positions"] == seen
    assert report["slots_kept"] == sum(len(p) for p in lists) == 4 * 2 * (12 + 0)  # budget per layer and head
    assert report["slots_total"] == seen * len(lists)
    for key, names in (("by_class", TOKEN_CLASSES), ("by_position", POSITION_BUCKETS)):
        rows = report[key]
        assert list(rows) == list(names)
        assert sum(r["kept"] for r in rows.values()) == report["slots_kept"]
        assert sum(r["total"] for r in rows.values()) == report["slots_total"]
        assert sum(r["expected_kept"] for r in rows.values()) == pytest.approx(report["slots_kept"])
    # Independently: kept slots per position bucket from the kept lists.
    counts = {name: 0 for name in POSITION_BUCKETS}
    for positions in lists:
        for p in positions:
            counts[position_bucket(p, seen)] += 1
    assert {k: r["kept"] for k, r in report["by_position"].items()} == counts
    texts = trace.document["token_texts"]
    words = sum(token_class(texts[p]) == "words" for positions in lists for p in positions)
    assert report["by_class"]["words"]["kept"] == words
    lift = report["by_position"]["recent"]["lift"]
    assert lift == pytest.approx(counts["recent"] / report["by_position"]["recent"]["total"] / report["kept_fraction"])


def test_a_tier_1_trace_says_which_tier_it_needs(tiny_engine, one_thread, tmp_path):
    _, trace = _trace(tiny_engine, tmp_path, build_policy("streaming", 12), tier=1)
    with pytest.raises(RecordError, match=r"is tier 1; bias analysis needs tier >= 2"):
        bias_report(trace)


def test_dense_keeps_everything_uniformly(tiny_engine, one_thread, tmp_path):
    _, trace = _trace(tiny_engine, tmp_path, build_policy("dense"), tier=2)
    report = bias_report(trace).to_json()
    assert report["kept_fraction"] == 1.0
    assert all(r["lift"] in (None, 1.0) for key in ("by_class", "by_position") for r in report[key].values())
    assert np.isclose(report["by_position"]["sinks"]["retained_fraction"], 1.0)
