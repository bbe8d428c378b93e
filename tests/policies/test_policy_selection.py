"""``select_keep``: the shared selection rule (top budget per head, ascending, ties to the lower position)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseety.policies import select_keep
from sparseety.policies.base import protect, recent_mask


def test_ties_go_to_the_lower_position():
    scores = torch.tensor([[[1.0, 2.0, 2.0, 2.0, 1.0, 2.0]]])
    assert select_keep(scores, 2).tolist() == [[[1, 2]]]
    assert select_keep(scores, 5).tolist() == [[[0, 1, 2, 3, 5]]]
    assert select_keep(torch.zeros(1, 1, 7), 3).tolist() == [[[0, 1, 2]]]


def test_each_head_selects_on_its_own_and_output_is_ascending():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.7], [0.8, 0.2, 0.9, 0.1]]])
    assert select_keep(scores, 2).tolist() == [[[1, 3], [0, 2]]]


def test_protected_slots_win_and_tie_among_themselves_by_position():
    scores = protect(torch.tensor([[[5.0, 1.0, 9.0, 1.0, 2.0]]]), torch.tensor([[[False, True, False, True, True]]]))
    assert select_keep(scores, 3).tolist() == [[[1, 3, 4]]]
    assert select_keep(scores, 2).tolist() == [[[1, 3]]]


def test_recent_mask_is_per_head_newest_positions():
    positions = torch.tensor([[[0, 1, 5, 6, 7], [0, 2, 3, 4, 7]]])
    assert recent_mask(positions, 2).tolist() == [[[False, False, False, True, True], [False, False, False, False, True]]]
    assert not recent_mask(positions, 0).any()


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=24),
    data=st.data(),
)
def test_select_keep_properties(values, data):
    """Keeps ``budget`` slots, ascending; every kept score >= every dropped one; at the boundary
    score, every kept slot lies before every dropped one."""
    n = len(values)
    budget = data.draw(st.integers(min_value=1, max_value=n))
    scores = torch.tensor(values, dtype=torch.float32).reshape(1, 1, n)
    keep = select_keep(scores, budget)[0, 0].tolist()
    assert len(keep) == budget and keep == sorted(keep) and len(set(keep)) == budget
    dropped = [i for i in range(n) if i not in keep]
    if dropped:
        assert min(values[i] for i in keep) >= max(values[i] for i in dropped)
        boundary = min(values[i] for i in keep)
        tied_kept = [i for i in keep if values[i] == boundary]
        tied_dropped = [i for i in dropped if values[i] == boundary]
        if tied_dropped:
            assert max(tied_kept) < min(tied_dropped)
