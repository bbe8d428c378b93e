"""Passkey cases (no model): deterministic per seed, real license text, the needle where the depth says."""

from __future__ import annotations

import re
from itertools import accumulate

import pytest

from sparseety.suites.passkey import (
    LICENSE_DIR,
    NEEDLE,
    is_correct,
    make_case,
    make_cases,
    word_count,
)
from sparseety.errors import ConfigError


def test_same_seed_same_case_other_seed_other_case():
    assert make_case(600, 0.5, seed=3) == make_case(600, 0.5, seed=3)
    assert make_cases([300, 600], [0.1, 0.9], seed=3) == make_cases([300, 600], [0.1, 0.9], seed=3)
    other = make_case(600, 0.5, seed=4)
    assert other.passkey != make_case(600, 0.5, seed=3).passkey
    assert other.context != make_case(600, 0.5, seed=3).context


def test_case_is_license_text_with_one_needle():
    case = make_case(800, 0.3, seed=1)
    assert re.fullmatch(r"\d{5,7}", case.passkey)
    assert case.needle == NEEDLE.format(passkey=case.passkey) == f"The pass key is {case.passkey}. Remember it."
    assert case.context.count(case.needle) == 1
    haystack = case.context.replace(case.needle + " ", "", 1).replace(" " + case.needle, "", 1)
    corpus = re.sub(r"\s+", " ", " ".join(p.read_text(errors="replace") for p in sorted(LICENSE_DIR.iterdir())
                                         if p.is_file() and not p.is_symlink()))
    assert haystack[:200] in corpus  # real text, not generated
    assert case.context_tokens == word_count(case.context)
    assert abs(case.context_tokens - 800) <= 100


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
@pytest.mark.parametrize("seed", [0, 7])
def test_needle_sits_at_the_closest_sentence_boundary_to_the_depth(depth, seed):
    case = make_case(1500, depth, seed=seed)
    start = case.context.index(case.needle)
    before = word_count(case.context[:start])
    assert before == case.needle_token
    haystack = case.context[:start] + case.context[start + len(case.needle):]
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", haystack.strip()) if s]
    boundaries = [0, *accumulate(word_count(s) for s in sentences)]
    total = boundaries[-1]
    assert before in boundaries
    assert abs(before - depth * total) == min(abs(b - depth * total) for b in boundaries)
    assert abs(before / total - depth) <= max(word_count(s) for s in sentences) / total


def test_token_counter_is_used_for_lengths():
    chars = make_case(400, 0.5, seed=2, count_tokens=len)  # characters as "tokens"
    assert chars.context_tokens == len(chars.context) and abs(len(chars.context) - 400) < 400


@pytest.mark.parametrize(("passkey", "answer", "correct"), [
    ("123456", "The pass key is 123456.", True), ("123456", "It is 123,456", True), ("123456", "1 2 3 4 5 6", True),
    ("123456", "The pass key is 12345.", False), ("123456", "", False),
])
def test_is_correct(passkey, answer, correct):
    assert is_correct(passkey, answer) is correct


def test_bad_lengths_and_depths():
    with pytest.raises(ConfigError, match="depth must be in \\[0, 1\\], got 1.5"):
        make_case(600, 1.5)
    with pytest.raises(ConfigError, match="at least 50 tokens, got 10"):
        make_case(10, 0.5)
