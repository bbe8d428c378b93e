"""Continuous batching: a flat signal split by ``cu_seqlens`` gives the per-request rankings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseety.config import ExtractionConfig
from sparseety.errors import AlignmentError, ShapeError
from sparseety.extract import extract, extract_ragged, extract_ragged_detailed

LENGTHS = [5, 1, 8, 3]
CU = np.concatenate([[0], np.cumsum(LENGTHS)])
TOKENS = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(LENGTHS, start=1)]


def dicts(records):
    return [r.to_dict() for r in records]


@pytest.mark.parametrize("score_type", ["route", "activation"])
def test_token_major_signals_split_per_request(score_type):
    flat = np.random.default_rng(0).random((int(CU[-1]), 6))
    cfg = ExtractionConfig(score_type=score_type, min_score=0.0)
    got = extract_ragged(TOKENS, flat, CU, cfg)
    assert len(got) == len(LENGTHS)
    for i, (start, end) in enumerate(zip(CU, CU[1:])):
        assert dicts(got[i]) == dicts(extract(TOKENS[i], flat[start:end], cfg))
        assert {r.token_id for r in got[i]} <= set(TOKENS[i])


def test_decode_attention_with_one_query_row_per_request():
    flat = torch.rand(3, len(LENGTHS), int(CU[-1]))  # [heads, requests, total keys]
    cfg = ExtractionConfig(layout="hqk", min_score=0.0, head_reduce="none")
    got = extract_ragged(TOKENS, flat, torch.from_numpy(CU), cfg)
    for i, (start, end) in enumerate(zip(CU, CU[1:])):
        assert dicts(got[i]) == dicts(extract(TOKENS[i], flat[:, i : i + 1, start:end], cfg))


def test_prefill_attention_keeps_the_diagonal_blocks():
    total = int(CU[-1])
    flat = torch.rand(total, total, 2)  # layout "kqh" is not a layout: use hkq after a permute
    flat = flat.permute(2, 0, 1)  # [heads, keys, queries]
    cfg = ExtractionConfig(layout="hkq", min_score=0.0)
    results = extract_ragged_detailed(TOKENS, flat, CU.tolist(), cfg, prompt_lens=[n - 1 for n in LENGTHS])
    for i, (start, end) in enumerate(zip(CU, CU[1:])):
        block = flat[:, start:end, start:end]
        expected = extract(TOKENS[i], block, cfg, prompt_len=LENGTHS[i] - 1)
        assert dicts(results[i].records) == dicts(expected)
        assert results[i].token_scores.shape == (1, LENGTHS[i])


def test_empty_requests_are_allowed():
    flat = np.ones((4, 2))
    got = extract_ragged(
        [[1, 2], [], [3, 4]], flat, [0, 2, 2, 4], ExtractionConfig(score_type="activation", min_score=0.0)
    )
    assert [len(r) for r in got] == [2, 0, 2]


@pytest.mark.parametrize("cu", [[0, 5, 18], [1, 5, 17], [0, 9, 5, 17], [17], [0, 5, 16]])
def test_bad_cu_seqlens(cu):
    with pytest.raises(ShapeError, match="cu_seqlens"):
        extract_ragged([[1]] * (len(cu) - 1), np.ones((17, 2)), cu, ExtractionConfig(score_type="activation"))


def test_mismatches_are_typed_errors():
    cfg = ExtractionConfig(score_type="activation")
    with pytest.raises(AlignmentError, match="3 requests but token_ids holds 2"):
        extract_ragged([[1], [2]], np.ones((3, 2)), [0, 1, 2, 3], cfg)
    with pytest.raises(AlignmentError, match="prompt_lens"):
        extract_ragged([[1], [2]], np.ones((2, 2)), [0, 1, 2], cfg, prompt_lens=[1])
    with pytest.raises(AlignmentError, match="2 tokens"):
        extract_ragged([[1], [2, 3, 4]], np.ones((3, 2)), [0, 2, 3], cfg)
    with pytest.raises(ShapeError, match="query rows"):
        extract_ragged([[1], [2]], np.ones((1, 3, 2)), [0, 1, 2], ExtractionConfig(layout="hqk"))
    nan = np.ones((3, 2))
    nan[2, 0] = np.nan
    with pytest.raises(ShapeError, match="NaN"):
        extract_ragged([[1], [2, 3]], nan, [0, 1, 3], cfg)
