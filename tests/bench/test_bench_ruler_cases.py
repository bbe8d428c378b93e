"""RULER-style generators: deterministic per seed, the expected answers really in the context where the case
says (checked by parsing the generated text independently of the generator), RULER's scoring, and the
encoding that keeps the question and answer prefix out of the compressed part."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from sparseety.suites.ruler import (
    MAX_NEW_TOKENS,
    NIAH_PREAMBLE,
    TASKS,
    case_depth,
    make_ruler_case,
    make_ruler_cases,
    score,
)
from sparseety.errors import ConfigError

NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")
ASSIGN = re.compile(r"VAR ([A-Z]{5}) = (?:(\d{5})|VAR ([A-Z]{5}))\.")


@pytest.mark.parametrize("task", TASKS)
def test_a_case_is_a_pure_function_of_task_length_index_and_seed(task):
    a = make_ruler_case(task, 600, 2, seed=5)
    assert a == make_ruler_case(task, 600, 2, seed=5)
    assert make_ruler_case(task, 600, 2, seed=6).context != a.context
    assert make_ruler_case(task, 600, 3, seed=5).context != a.context
    assert a.max_new_tokens == MAX_NEW_TOKENS[task] and a.task == task and a.length == 600
    assert abs(a.context_tokens - 600) < 60  # whitespace words with the default counter


def test_more_cases_extend_fewer_and_depths_spread():
    three = make_ruler_cases(["niah_single"], [500], 3, seed=1)
    five = make_ruler_cases(["niah_single"], [500], 5, seed=1)
    assert five[:3] == three
    assert [case_depth(i) for i in range(5)] == [0.5, 0.16, 0.71, 0.37, 0.92]
    assert [c.depth for c in five] == [case_depth(i) for i in range(5)]


@pytest.mark.parametrize("length", [500, 1500])
def test_niah_single_needle_is_at_its_depth(length):
    for index in range(3):
        case = make_ruler_case("niah_single", length, index, seed=0)
        found = NEEDLE.findall(case.context)
        assert len(found) == 1
        key, value = found[0]
        assert case.expected == (value,) and key in case.question and key in case.answer_prefix
        assert case.context.startswith(NIAH_PREAMBLE + " ")
        before = case.context[: case.context.index("One of the special magic")]
        prose_before = len(before.split()) - len(NIAH_PREAMBLE.split())
        prose = case.context_tokens - len(NIAH_PREAMBLE.split()) - len(case.inserts[0].split())
        assert abs(prose_before / prose - case.depth) < 0.06  # the sentence boundary nearest the depth
        assert case.insert_tokens[0] == len(before.split())


def test_niah_multikey_asks_one_of_four_distinct_keys():
    case = make_ruler_case("niah_multikey", 800, 1, seed=3)
    found = NEEDLE.findall(case.context)
    assert len(found) == 4 and len({k for k, _ in found}) == 4 and len({v for _, v in found}) == 4
    asked = re.search(r"number for ([a-z]+-[a-z]+) mentioned", case.question).group(1)
    assert case.expected == (dict(found)[asked],)
    assert sorted(case.inserts) == sorted(f"One of the special magic numbers for {k} is: {v}." for k, v in found)


def test_niah_multivalue_expects_every_value_of_its_one_key():
    case = make_ruler_case("niah_multivalue", 800, 0, seed=3)
    found = NEEDLE.findall(case.context)
    assert len(found) == 4 and len({k for k, _ in found}) == 1
    assert sorted(case.expected) == sorted(v for _, v in found)
    assert "all the special magic numbers for " + found[0][0] in case.question


def test_vt_chain_reads_in_order_and_resolves_to_the_asked_value():
    for index in range(3):
        case = make_ruler_case("vt", 1000, index, seed=2)
        value = re.search(r"assigned the value (\d{5})", case.question).group(1)
        holds: dict[str, str] = {}
        order = []
        for name, number, source in ASSIGN.findall(case.context):  # in reading order
            holds[name] = number or holds[source]  # a variable is assigned only after its source
            order.append(name)
        assert sorted(n for n, v in holds.items() if v == value) == sorted(case.expected)
        assert len(case.expected) == 5 and order == list(case.expected)
        assert f"5 variables are assigned the value {value}" in case.answer_prefix


@pytest.mark.parametrize("length", [600, 2000])
def test_cwe_expects_the_ten_most_frequent_words(length):
    case = make_ruler_case("cwe", length, 0, seed=4)
    body = case.context.split("most often. ", 1)[1]
    numbered = re.findall(r"(\d+)\. ([a-z]+)", body)
    assert [int(n) for n, _ in numbered] == list(range(1, len(numbered) + 1))
    counts = Counter(w for _, w in numbered)
    top = [w for w, c in counts.items() if c == 6]
    assert sorted(top) == sorted(case.expected) and len(top) == 10
    assert set(counts.values()) == {6, 1}
    assert case.context_tokens <= length and case.context_tokens > length - 10


def test_bad_task_and_length_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown RULER task 'qa'; valid tasks: niah_single"):
        make_ruler_case("qa", 1000)
    with pytest.raises(ConfigError, match="at least 200 tokens, got 100 \\(task vt\\)"):
        make_ruler_case("vt", 100)


def test_scoring_is_recall_of_whole_items():
    assert score(["1234567"], " 1234567.") == 1.0
    assert score(["1234567"], "It is 1,234,567") == 1.0
    assert score(["1234567"], "12345678") == 0.0  # inside a longer number
    assert score(["1234567", "7654321"], "1234567 and 7654321") == 1.0
    assert score(["1234567", "7654321", "1111111", "2222222"], "1234567, 2222222") == 0.5
    assert score(["ABCDE", "FGHIJ"], "VAR abcde") == 0.5  # any case
    assert score(["law", "notice"], "lawful notices") == 0.0
    assert score(["law", "notice"], "1. law 2. notice") == 1.0


def test_encoding_keeps_question_and_prefix_out_of_the_compressed_part(smollm):
    from sparseety.suites.ruler import encode_case

    _, tokenizer = smollm
    case = make_ruler_case("niah_single", 300, 0, seed=0)
    for chat in (True, False):
        encoded = encode_case(tokenizer, case, chat)
        ids = encoded.input_ids[0].tolist()
        context = tokenizer.decode(ids[: encoded.compress_len])
        tail = tokenizer.decode(ids[encoded.compress_len:])
        assert case.expected[0] in context and case.expected[0] not in tail
        assert case.question in tail and tail.rstrip().endswith(case.answer_prefix)
        assert ("<|im_start|>assistant" in tail) == chat
