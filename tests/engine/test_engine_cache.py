"""``SparseCache`` / ``SparseLayer``: real compaction, original positions, tokens seen."""

from __future__ import annotations

import pytest
import torch

from sparseety.engine import SparseCache, SparseLayer


def filled(n: int, kvh: int = 2, d: int = 4) -> tuple[SparseLayer, torch.Tensor]:
    layer = SparseLayer()
    keys = torch.arange(n * kvh * d, dtype=torch.float32).reshape(1, kvh, n, d)
    layer.update(keys, -keys)
    return layer, keys


def test_compaction_keeps_positions_and_shrinks_memory():
    layer, keys = filled(6)
    before = layer.nbytes()
    keep = torch.tensor([[[0, 2, 5], [1, 3, 4]]])
    slots, positions = layer.compact(keep)
    assert slots.tolist() == [[[1, 3, 4], [0, 2, 5]]]
    assert positions.tolist() == [[[1, 3, 4], [0, 2, 5]]]
    assert layer.positions.tolist() == [[[0, 2, 5], [1, 3, 4]]]
    assert torch.equal(layer.keys[0, 0], keys[0, 0, [0, 2, 5]])
    assert torch.equal(layer.values[0, 1], -keys[0, 1, [1, 3, 4]])
    assert layer.nbytes() == before // 2
    assert layer.get_seq_length() == 6 and layer.num_slots() == 3


def test_new_tokens_get_the_next_positions_after_compaction():
    layer, _ = filled(6)
    layer.compact(torch.tensor([[[0, 5], [4, 5]]]))
    layer.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    assert layer.positions.tolist() == [[[0, 5, 6, 7], [4, 5, 6, 7]]]
    assert layer.get_seq_length() == 8


def test_crop_removes_the_newest_tokens_and_refuses_evicted_ones():
    layer, _ = filled(6)
    layer.crop(-2)
    assert layer.positions.tolist() == [[[0, 1, 2, 3], [0, 1, 2, 3]]] and layer.get_seq_length() == 4
    layer.compact(torch.tensor([[[0, 1, 2], [0, 1, 2]]]))  # position 3 evicted
    with pytest.raises(RuntimeError):
        layer.crop(-1)
    with pytest.raises(ValueError):
        layer.crop(1)


def test_cache_counts_cropped_tokens_and_sums_bytes():
    cache = SparseCache(3)
    for layer in cache.layers:
        layer.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    assert cache.get_seq_length() == 5
    assert cache.nbytes() == 3 * 2 * (2 * 5 * 4 * 4)
    cache.crop(-2)
    assert cache.cropped_tokens == 2 and cache.get_seq_length() == 3
    assert [p.shape[-1] for p in cache.kept_positions()] == [3, 3, 3]
