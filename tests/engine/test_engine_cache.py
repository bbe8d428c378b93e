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
    # a small eviction moves the newest survivors into the freed slots: a permutation of the kept set
    assert layer.positions.tolist() == [[[0, 5, 2], [3, 1, 4]]]
    for head in range(2):  # every slot's key and value still belong to the position it reports
        for slot, position in enumerate(layer.positions[0, head].tolist()):
            assert torch.equal(layer.keys[0, head, slot], keys[0, head, position])
            assert torch.equal(layer.values[0, head, slot], -keys[0, head, position])
    assert layer.nbytes() == before // 2
    assert layer.get_seq_length() == 6 and layer.num_slots() == 3


def test_a_large_eviction_reallocates_in_position_order_and_frees_the_buffer():
    layer, keys = filled(600)
    allocated = layer.allocated_bytes()
    keep = torch.arange(500, 600).expand(1, 2, 100)
    layer.compact(keep)
    assert layer.positions.tolist() == [[list(range(500, 600))] * 2]
    assert torch.equal(layer.keys, keys[:, :, 500:])
    assert layer.allocated_bytes() < allocated / 4  # the buffer itself shrank, not just the live view


def test_appends_write_into_the_buffer_without_copying_it():
    layer, _ = filled(6)
    buffer = layer._k.data_ptr()
    for _ in range(10):
        layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
        oldest = layer.positions[0] == layer.positions[0].amin(dim=-1, keepdim=True)
        layer.compact((~oldest).nonzero()[:, 1].view(1, 2, -1))  # evict the oldest position per step
    assert layer._k.data_ptr() == buffer and layer.num_slots() == 6
    assert sorted(layer.positions[0, 0].tolist()) == list(range(10, 16))


def test_new_tokens_get_the_next_positions_after_compaction():
    layer, _ = filled(6)
    layer.compact(torch.tensor([[[0, 5], [4, 5]]]))
    layer.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    assert layer.positions[..., -2:].tolist() == [[[6, 7], [6, 7]]]  # new rows are always the last slots
    assert [sorted(h) for h in layer.positions[0].tolist()] == [[0, 5, 6, 7], [4, 5, 6, 7]]
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
    assert [[p.tolist() for p in heads] for heads in cache.kept_positions()] == [[[0, 1, 2]] * 2] * 3


def test_a_split_layer_holds_each_heads_own_slots_and_only_those_bytes():
    layer = SparseLayer()
    keys = torch.arange(3 * 6 * 4, dtype=torch.float32).reshape(1, 3, 6, 4)
    layer.update(keys, -keys)
    evicted = layer.split([torch.tensor([5, 0]), torch.tensor([1, 2, 3, 4]), torch.tensor([2])], budgets=[2, 4, 1])
    assert [e[1][0, 0].tolist() for e in evicted] == [[1, 2, 3, 4], [0, 5], [0, 1, 3, 4, 5]]
    assert [p.tolist() for p in layer.head_slots()] == [[0, 5], [1, 2, 3, 4], [2]]
    regions = layer.regions
    assert torch.equal(regions.head_keys(1)[0][0, 0], keys[0, 1, 1:5])
    assert torch.equal(regions.head_keys(2)[1][0, 0], -keys[0, 2, 2:3])
    assert layer.nbytes() == 2 * (2 + 4 + 1) * 4 * 4 and layer.num_slots() == 7
    assert int((layer.positions >= 0).sum()) == 7  # the rest of the row is free room
    new = torch.arange(3 * 4, dtype=torch.float32).reshape(1, 3, 1, 4) + 100
    for step in range(12):  # past every region's room: they grow, nothing is lost
        layer.update(new + step, new + step)
    assert layer.seen == 18
    assert [p.tolist() for p in layer.head_slots()] == [[0, 5, *range(6, 18)], [1, 2, 3, 4, *range(6, 18)],
                                                        [2, *range(6, 18)]]
    assert torch.equal(layer.regions.head_keys(2)[0][0, 0, -1], (new + 11)[0, 2, 0])
    assert torch.equal(layer.regions.head_keys(0)[0][0, 0, 0], keys[0, 0, 0])
    with pytest.raises(RuntimeError, match="split per head"):
        layer.truncate(1)
    with pytest.raises(RuntimeError, match="split per head"):
        layer.crop(-1)


def test_a_split_layer_evicts_inside_each_heads_region():
    layer = SparseLayer()
    keys = torch.arange(2 * 5 * 2, dtype=torch.float32).reshape(1, 2, 5, 2)
    layer.update(keys, keys)
    layer.split([torch.arange(5), torch.tensor([0, 4])], budgets=[3, 1])
    regions = layer.regions
    start1 = regions.offsets[1]
    slots, heads, positions = regions.evict(torch.tensor([1, 3, start1]))
    assert heads.tolist() == [0, 0, 1] and positions.tolist() == [1, 3, 0] and slots.tolist() == [1, 3, start1]
    assert [p.tolist() for p in layer.head_slots()] == [[0, 4, 2], [4]]  # the region's last slots filled its holes
    assert torch.equal(regions.head_keys(0)[0][0, 0], keys[0, 0, [0, 4, 2]])
    assert regions.counts == [3, 1] and int((regions.pos >= 0).sum()) == 4


def test_a_decode_eviction_drops_each_heads_lowest_ties_to_the_newest_and_fills_the_hole_from_its_end():
    layer = SparseLayer()
    keys = torch.arange(3 * 5 * 2, dtype=torch.float32).reshape(1, 3, 5, 2)
    layer.update(keys, -keys)
    layer.split([torch.arange(5), torch.tensor([0, 1, 2]), torch.tensor([1, 3, 4])], budgets=[4, 3, 2])
    regions = layer.regions
    o = regions.offsets
    scores = torch.full((regions.pos.shape[-1],), float("inf"))  # free room: +inf, as the engine passes it
    scores[o[0] : o[0] + 5] = torch.tensor([0.5, 0.1, 0.9, 0.1, 0.7])  # tie at positions 1 and 3: the newest goes
    scores[o[1] : o[1] + 3] = torch.tensor([0.0, 0.0, 0.0])  # at its budget: untouched
    scores[o[2] : o[2] + 3] = torch.tensor([0.8, 0.6, 0.2])  # its last slot is the lowest: no move
    slots, heads, positions = regions.evict_over_budget(scores)
    assert slots.tolist() == [o[0] + 3, o[2] + 2] and heads.tolist() == [0, 2] and positions.tolist() == [3, 4]
    assert [p.tolist() for p in layer.head_slots()] == [[0, 1, 2, 4], [0, 1, 2], [1, 3]]
    assert torch.equal(regions.head_keys(0)[0][0, 0], keys[0, 0, [0, 1, 2, 4]])
    assert torch.equal(regions.head_keys(0)[1][0, 0], -keys[0, 0, [0, 1, 2, 4]])
    assert regions.counts == [4, 3, 2] and int((regions.pos >= 0).sum()) == 9
    assert len(regions.evict_over_budget(scores)[0]) == 0  # every head at its budget


@pytest.mark.parametrize("seed", range(6))
def test_the_decode_steps_per_head_eviction_drops_what_the_row_wide_selection_drops(seed):
    """The decode step's head-by-head path against ``select_evict_by_head`` + ``evict`` on a copy: integer
    scores (many ties), scrambled slots, free room, a head at its budget."""
    import copy

    from sparseety.policies.base import select_evict_by_head

    g = torch.Generator().manual_seed(seed)
    layer = SparseLayer()
    layer.update(torch.randn(1, 3, 40, 2, generator=g), torch.randn(1, 3, 40, 2, generator=g))
    keep = [torch.randperm(40, generator=g)[: 10 + 5 * i] for i in range(3)]
    layer.split(keep, budgets=[10, 16, 20])  # head 1 below its budget: at the first step it evicts nothing
    regions = layer.regions
    regions.state = torch.zeros(1, 1, regions.pos.shape[-1])
    for step in range(8):  # append, then one out of each head over its budget (from step 1 every head is)
        regions.append(torch.randn(1, 3, 1, 2, generator=g), torch.randn(1, 3, 1, 2, generator=g), 40 + step)
        regions.state.copy_(torch.randint(0, 3, regions.state.shape, generator=g).float())
        scores = regions.state[0, 0].clone()
        other = copy.deepcopy(regions)  # its flat views stay views of its own buffers
        expected = other.evict(select_evict_by_head(scores, other.pos[0, 0], other.owner[0, 0], other.budget_tensor,
                                                    other.counts))
        got = regions.evict_over_budget(scores)
        for a, b in zip(got, expected):
            assert a.tolist() == b.tolist()
        for name in ("k", "v", "pos", "state"):
            assert torch.equal(getattr(regions, name), getattr(other, name)), name
        assert regions.counts == other.counts


def test_select_evict_by_head_leaves_each_head_its_budget_ties_to_the_lower_position():
    from sparseety.policies.base import select_evict_by_head

    scores = torch.tensor([1.0, 5.0, 1.0, 2.0, 2.0, 9.0, 0.5])
    positions = torch.tensor([3, 0, 1, 7, 2, 4, 9])
    heads = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    evicted = select_evict_by_head(scores, positions, heads, torch.tensor([2, 1, 1]))
    # head 0 keeps 5.0 and the tied 1.0 at the lower position (1, slot 2); head 1 keeps 9.0; head 2 its one slot
    assert sorted(evicted.tolist()) == [0, 3, 4]
    one_each = select_evict_by_head(scores, positions, heads, torch.tensor([2, 2, 1]))  # the decode step's path
    assert sorted(one_each.tolist()) == [0, 3]  # head 1: of its lowest (2.0 at positions 7 and 2), the newest
    free = positions.masked_fill(torch.arange(7) == 6, -1)  # a free slot (position -1) is never chosen nor counted
    assert sorted(select_evict_by_head(scores, free, heads, torch.tensor([2, 1, 0])).tolist()) == [0, 3, 4]
    assert sorted(select_evict_by_head(scores, free, heads, torch.tensor([2, 2, 0])).tolist()) == [0, 3]


@pytest.mark.parametrize("slot", [1, 4])
def test_a_decode_eviction_in_a_single_kv_head_moves_the_last_slot(slot):
    """One KV head (Gemma 3 270M): the decode step's one-slot eviction copies the last slot into the hole, also
    when the hole is the last slot itself (a contiguous row copied onto itself)."""
    layer, keys = filled(5, kvh=1)
    slots, positions = layer.evict(torch.tensor([[[slot]]]))
    assert slots.tolist() == [[[slot]]] and positions.tolist() == [[[slot]]]
    assert layer.num_slots() == 4 and slot not in layer.positions[0, 0].tolist()
    for i, position in enumerate(layer.positions[0, 0].tolist()):
        assert torch.equal(layer.keys[0, 0, i], keys[0, 0, position])
        assert torch.equal(layer.values[0, 0, i], -keys[0, 0, position])
