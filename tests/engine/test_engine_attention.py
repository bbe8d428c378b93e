"""The hook point's attention pieces against a naive full-matrix reference (small shapes only)."""

from __future__ import annotations

import pytest
import torch

from sparseety.engine.attention import causal_attention, column_sums, row_probs


def naive(query, key, value, scale):
    """Full ``[b, heads, q, n]`` probabilities with slot causality (row i sees slots 0 .. n - q + i)."""
    b, h, q, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    k = key.repeat_interleave(h // kvh, dim=1)
    v = value.repeat_interleave(h // kvh, dim=1)
    logits = query @ k.transpose(-1, -2) * scale
    rows = torch.arange(q).unsqueeze(1)
    cols = torch.arange(n).unsqueeze(0)
    probs = torch.softmax(logits.masked_fill(cols > rows + (n - q), float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2), probs


def tensors(q, n, heads=4, kvh=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, q, d, generator=g), torch.randn(1, kvh, n, d, generator=g),
            torch.randn(1, kvh, n, d, generator=g))


@pytest.mark.parametrize(("q", "n", "block"), [(10, 10, 3), (10, 10, 512), (4, 11, 3), (1, 9, 2), (7, 7, 1)])
def test_blockwise_column_sums_equal_the_full_matrix(q, n, block):
    query, key, value = tensors(q, n)
    colsum = column_sums(query, key, 0.35, stride=1, block=block)
    probs = naive(query, key, value, 0.35)[1]
    assert torch.allclose(colsum, probs.sum(dim=2), atol=1e-5)
    assert torch.allclose(colsum.sum(dim=-1), torch.full((1, 4), float(q)), atol=1e-4)


@pytest.mark.parametrize(("q", "n", "stride", "block"), [(10, 10, 3, 2), (9, 12, 2, 512), (5, 5, 5, 1)])
def test_strided_column_sums_use_every_kth_row_from_the_last(q, n, stride, block):
    query, key, value = tensors(q, n, seed=3)
    colsum = column_sums(query, key, 0.35, stride=stride, block=block)
    probs = naive(query, key, value, 0.35)[1]
    rows = list(range(q - 1, -1, -stride))
    assert torch.allclose(colsum, probs[:, :, rows].sum(dim=2) * stride, atol=1e-5)


@pytest.mark.parametrize(("q", "n"), [(3, 10), (5, 5), (1, 6)])
def test_causal_attention_with_fewer_queries_than_slots(q, n):
    """The long-document question forward and speculative verification: q new rows over n slots."""
    query, key, value = tensors(q, n, seed=1)
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 2  # read by transformers' SDPA path (q == 1 or q == n)
    out = causal_attention(module, query, key, value, 0.35)
    assert torch.allclose(out, naive(query, key, value, 0.35)[0], atol=1e-5)


@pytest.mark.parametrize(("q", "rows", "n"), [(6, 3, 6), (4, 4, 9), (1, 1, 5)])
def test_row_probs_are_the_last_rows(q, rows, n):
    query, key, value = tensors(q, n, seed=2)
    probs = row_probs(query[:, :, q - rows:], key, 0.35)
    assert torch.allclose(probs, naive(query, key, value, 0.35)[1][:, :, q - rows:], atol=1e-6)


def test_decode_attention_with_probs_matches_sdpa_and_row_probs():
    """The single-pass decode path gives SDPA's output and row_probs' probabilities."""
    from sparseety.engine.attention import decode_attention_with_probs, row_probs

    torch.manual_seed(3)
    query, key, value = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8)
    out, probs = decode_attention_with_probs(query, key, value, 0.35)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=0.35, enable_gqa=True)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-6)
    assert torch.allclose(probs, row_probs(query, key, 0.35)[:, :, 0], atol=1e-7)
