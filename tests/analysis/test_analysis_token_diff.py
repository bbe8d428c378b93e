"""Token diff: the opcodes rebuild the sparse sequence, and the first divergence is the first differing step."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sparseety.analysis.token_diff import apply_ops, first_divergence, token_diff

ids = st.lists(st.integers(min_value=0, max_value=6), max_size=30)


@given(ids, ids)
def test_opcodes_rebuild_the_sparse_sequence(baseline, sparse):
    diff = token_diff(baseline, sparse, decode=lambda t: f"<{t}>")
    assert apply_ops(baseline, diff.ops) == sparse
    # Token texts are the decoded ids of each side's span, and the spans tile both sequences.
    assert "".join("".join(op.sparse_tokens) for op in diff.ops) == "".join(f"<{t}>" for t in sparse)
    assert [t for op in diff.ops for t in op.baseline_ids] == baseline


@given(ids, ids)
def test_first_divergence_is_the_first_differing_step(baseline, sparse):
    expected = next((i for i in range(max(len(baseline), len(sparse)))
                     if i >= len(baseline) or i >= len(sparse) or baseline[i] != sparse[i]), None)
    assert first_divergence(baseline, sparse) == expected
    assert token_diff(baseline, sparse).first_divergence == expected


def test_equal_outputs():
    diff = token_diff([5, 6, 7], [5, 6, 7], decode=str)
    assert diff.ratio == 1.0 and diff.first_divergence is None
    assert [op.tag for op in diff.ops] == ["equal"]


def test_known_edit():
    diff = token_diff([1, 2, 3, 4], [1, 9, 3], decode=lambda t: f"t{t}")
    assert diff.first_divergence == 1
    assert diff.ratio == 2 * 2 / 7  # SequenceMatcher: 2 * matches / total length
    doc = diff.to_dict()
    assert [(op["tag"], op["baseline_tokens"], op["sparse_tokens"]) for op in doc["ops"]] == [
        ("equal", ["t1"], ["t1"]), ("replace", ["t2"], ["t9"]), ("equal", ["t3"], ["t3"]), ("delete", ["t4"], []),
    ]
