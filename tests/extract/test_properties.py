"""Property tests of the extractor's invariants (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sparseety.config import ExtractionConfig
from sparseety.extract import extract, extract_detailed

# Small integers make ties common and every sum exact, so the reference comparison can be exact too.
values = st.integers(min_value=0, max_value=6).map(float)
configs = st.fixed_dictionaries(
    {
        "head_reduce": st.sampled_from(["mean", "max", "none"]),
        "query_reduce": st.sampled_from(["sum", "mean", "max", "last"]),
        "normalize": st.sampled_from(["l2", "l1", "max", "none"]),
        "top_k": st.integers(min_value=1, max_value=12),
        "min_score": st.sampled_from([0.0, 0.05, 0.3, 0.9]),
    }
)


# Dyadic values keep every sum exact whatever the summation order, so only true ties are ties.
fine_values = st.integers(min_value=0, max_value=2**20).map(lambda v: v / 2**20)


@st.composite
def signals(draw, fine: bool = False):
    heads, queries, keys = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 40))
    x = draw(arrays(np.float64, (heads, queries, keys), elements=fine_values if fine else values))
    ids = draw(st.lists(st.integers(0, 50), min_size=keys, max_size=keys))
    return ids, x


@settings(max_examples=150, deadline=None)
@given(signals(), configs)
def test_matches_the_naive_reference(reference, same_records, signal, cfg):
    ids, x = signal
    got = extract(ids, x, ExtractionConfig(**cfg))
    expected, _ = reference(ids, x, cfg)
    same_records(got, expected)


@settings(max_examples=150, deadline=None)
@given(signals(), configs)
def test_ranks_contiguous_scores_sorted_subset_and_top_k_bound(signal, cfg):
    ids, x = signal
    got = extract(ids, x, ExtractionConfig(**cfg))
    heads = sorted({r.head for r in got}, key=lambda h: -1 if h is None else h)
    for head in heads:
        ranking = [r for r in got if r.head == head]
        assert [r.rank for r in ranking] == list(range(len(ranking)))
        assert all(a.score >= b.score for a, b in zip(ranking, ranking[1:]))
        assert all(a.position < b.position for a, b in zip(ranking, ranking[1:]) if a.score == b.score)
        assert len(ranking) <= cfg["top_k"]
        assert len({r.position for r in ranking}) == len(ranking)
        assert all(r.score >= cfg["min_score"] for r in ranking)
    assert all(0 <= r.position < len(ids) and r.token_id == ids[r.position] for r in got)


@settings(max_examples=100, deadline=None)
@given(signals(fine=True), configs, st.randoms(use_true_random=False))
def test_permuting_tokens_and_their_columns_permutes_the_result(signal, cfg, rnd):
    ids, x = signal
    config = ExtractionConfig(**cfg)
    result = extract_detailed(ids, x, config)
    assume(all(len(set(row)) == len(row) for row in result.token_scores.tolist()))  # distinct scores
    order = list(range(len(ids)))
    rnd.shuffle(order)
    original = result.records
    permuted = extract([ids[i] for i in order], x[..., order], config)
    new_position = {old: new for new, old in enumerate(order)}
    assert [(r.head, r.rank, new_position[r.position], r.token_id) for r in original] == [
        (r.head, r.rank, r.position, r.token_id) for r in permuted
    ]
    assert [r.score for r in original] == pytest.approx([r.score for r in permuted], rel=1e-12)
