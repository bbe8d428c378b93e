"""The extractor against the naive reference, branch by branch, and its typed errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseety.config import ExtractionConfig
from sparseety.errors import AlignmentError, ConfigError, ShapeError
from sparseety.extract import extract, extract_detailed

RNG = np.random.default_rng(1234)


def attention(b: int, h: int, q: int, k: int, seed: int = 0) -> np.ndarray:
    """``[b, h, q, k]`` float64 softmax rows."""
    logits = np.random.default_rng(seed).normal(size=(b, h, q, k)) * 2
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def in_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """Re-express canonical ``[b, h, q, k]`` data in ``layout`` (absent axes must have size 1)."""
    for axis in "bh":
        if axis not in layout:
            x = x[0]
    present = [axis for axis in "bhqk" if axis in layout]
    return np.transpose(x, [present.index(axis) for axis in layout])


def check(reference, same_records, ids, x, prompt_len=None, layer=None, **cfg):
    """Extract with the real extractor and assert it matches the reference."""
    got = extract(ids, x, ExtractionConfig(**cfg), prompt_len=prompt_len, layer=layer)
    expected, _ = reference(ids, x, cfg, prompt_len=prompt_len, layer=layer)
    same_records(got, expected)
    return got


@pytest.mark.parametrize("layout", ["bhqk", "hqk", "qk", "bhkq", "hkq", "kq"])
@pytest.mark.parametrize("query_reduce", ["sum", "mean", "max", "last"])
def test_every_layout_and_query_reduce_matches_the_reference(reference, same_records, layout, query_reduce):
    canonical = attention(1, 1 if "h" not in layout else 3, 5, 12, seed=len(layout) * 7)
    x = in_layout(canonical, layout)
    ids = list(range(100, 112))
    got = check(reference, same_records, ids, x, layout=layout, query_reduce=query_reduce, min_score=0.0, top_k=12)
    assert len(got) == 12


@pytest.mark.parametrize("layout", ["bhkq", "hkq", "kq"])
def test_transposed_layouts_give_the_same_ranking_as_their_plain_twin(layout):
    canonical = attention(1, 3 if "h" in layout else 1, 4, 9, seed=3)
    plain = layout.replace("kq", "qk")
    cfg = {"min_score": 0.0, "top_k": 9}
    a = extract(list(range(9)), in_layout(canonical, layout), ExtractionConfig(layout=layout, **cfg))
    b = extract(list(range(9)), in_layout(canonical, plain), ExtractionConfig(layout=plain, **cfg))
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]


def test_layout_defaults_by_rank(reference, same_records):
    x = attention(1, 2, 3, 6, seed=5)
    ids = list(range(6))
    for data in (x, x[0], x[0, 0]):
        check(reference, same_records, ids, data, min_score=0.0)


@pytest.mark.parametrize("head_reduce", ["mean", "max"])
def test_head_reduce_matches_the_reference(reference, same_records, head_reduce):
    got = check(
        reference, same_records, list(range(10)), attention(1, 4, 6, 10, seed=9), head_reduce=head_reduce, top_k=5
    )
    assert all(r.head is None for r in got)


def test_head_reduce_none_ranks_each_head_and_sets_head(reference, same_records):
    got = check(
        reference,
        same_records,
        list(range(10)),
        attention(1, 3, 4, 10, seed=11),
        head_reduce="none",
        top_k=4,
        min_score=0.0,
    )
    assert [r.head for r in got] == [0] * 4 + [1] * 4 + [2] * 4
    assert [r.rank for r in got] == [0, 1, 2, 3] * 3


@pytest.mark.parametrize("how", ["l2", "l1", "max", "none"])
def test_normalize_variants(reference, same_records, how):
    got = check(
        reference,
        same_records,
        list(range(10)),
        attention(1, 2, 5, 10, seed=13),
        normalize=how,
        min_score=0.0,
        top_k=10,
    )
    scores = np.array([r.score for r in got])
    if how == "max":
        assert scores[0] == pytest.approx(1.0)
    elif how == "l1":
        assert scores.sum() == pytest.approx(1.0)
    elif how == "l2":
        assert np.linalg.norm(scores) == pytest.approx(1.0)


def test_top_k_and_min_score_both_apply():
    scores = np.array([[0.9, 0.1, 0.5, 0.04, 0.3, 0.06]])
    cfg = dict(layout="qk", normalize="none")
    ids = list(range(6))
    kept = lambda **kw: [r.position for r in extract(ids, scores, ExtractionConfig(**cfg, **kw))]
    assert kept(top_k=16, min_score=0.05) == [0, 2, 4, 1, 5]  # min_score binds
    assert kept(top_k=2, min_score=0.05) == [0, 2]  # top_k binds
    assert kept(top_k=3, min_score=0.4) == [0, 2]  # min_score binds again
    assert kept(top_k=100, min_score=0.0) == [0, 2, 4, 1, 5, 3]  # top_k above n: every passing token
    assert kept(top_k=6, min_score=0.5) == [0, 2]  # score == min_score is kept


def test_all_zero_scores_with_positive_min_score_are_empty():
    ids = list(range(7))
    assert extract(ids, np.zeros((2, 3, 7)), ExtractionConfig(min_score=0.05)) == []
    zeros = extract(ids, np.zeros((2, 3, 7)), ExtractionConfig(min_score=0.0, top_k=3))
    assert [r.position for r in zeros] == [0, 1, 2] and all(r.score == 0.0 for r in zeros)


def test_ties_go_to_the_lower_position_even_when_topk_cuts_through_them():
    row = np.full(50, 0.5)
    row[[3, 40]] = 1.0
    got = extract(list(range(50)), row[None], ExtractionConfig(layout="qk", top_k=5, normalize="none"))
    assert [r.position for r in got] == [3, 40, 0, 1, 2]
    shuffled = torch.from_numpy(row[None]).float()
    got = extract(torch.arange(50), shuffled, ExtractionConfig(layout="qk", top_k=49, normalize="none"))
    assert [r.position for r in got] == [3, 40] + [p for p in range(50) if p not in (3, 40)][:47]


def test_ranks_contiguous_and_scores_sorted_per_head():
    got = extract(
        list(range(30)), attention(1, 4, 3, 30, seed=17), ExtractionConfig(head_reduce="none", min_score=0.0, top_k=7)
    )
    for head in range(4):
        mine = [r for r in got if r.head == head]
        assert [r.rank for r in mine] == list(range(7))
        assert all(a.score >= b.score for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("route_input", ["probs", "logits"])
def test_route_scores_experts_and_load(reference, same_records, route_input):
    logits = RNG.normal(size=(9, 6))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    data = probs if route_input == "probs" else logits
    cfg = dict(score_type="route", route_input=route_input, experts_k=3, min_score=0.0, top_k=9)
    result = extract_detailed(list(range(9)), data, ExtractionConfig(**cfg))
    expected, load = reference(list(range(9)), data, cfg)
    same_records(result.records, expected)
    assert list(result.expert_load) == load and sum(load) == 9 * 3
    assert all(len(r.experts) == 3 for r in result.records)


def test_route_load_spots_a_hot_expert():
    probs = np.full((20, 4), 0.1)
    probs[:, 2] = 0.7
    result = extract_detailed(list(range(20)), probs, ExtractionConfig(score_type="route", experts_k=1))
    assert result.expert_load == (0, 0, 20, 0)


def test_route_expert_ties_go_to_the_lower_expert_id():
    probs = np.array([[0.25, 0.25, 0.25, 0.25]])
    result = extract_detailed([5], probs, ExtractionConfig(score_type="route", experts_k=2))
    assert result.records[0].experts == [[0, 0.25], [1, 0.25]]
    assert result.expert_load == (1, 1, 0, 0)


@pytest.mark.parametrize("reduce", ["maxabs", "l2", "nonzero_frac"])
def test_activation_reduces(reference, same_records, reduce):
    x = RNG.normal(size=(11, 16)) * (RNG.random((11, 16)) > 0.5)
    check(
        reference,
        same_records,
        list(range(11)),
        x,
        score_type="activation",
        activation_reduce=reduce,
        min_score=0.0,
        top_k=11,
    )


def test_activation_nonzero_frac_uses_zero_eps():
    x = np.array([[0.0, 1e-3, 1.0, 2.0], [0.0, 0.0, 0.0, 5.0]])
    cfg = dict(score_type="activation", activation_reduce="nonzero_frac", normalize="none", min_score=0.0)
    strict = extract([1, 2], x, ExtractionConfig(zero_eps=0.0, **cfg))
    loose = extract([1, 2], x, ExtractionConfig(zero_eps=0.01, **cfg))
    assert [(r.position, r.score) for r in strict] == [(0, 0.75), (1, 0.25)]
    assert [(r.position, r.score) for r in loose] == [(0, 0.5), (1, 0.25)]


def test_batched_signals_need_and_use_batch_index(reference, same_records):
    x = attention(3, 2, 4, 8, seed=21)
    with pytest.raises(ShapeError, match=r"batch of 3.*batch_index"):
        extract(list(range(8)), x, ExtractionConfig())
    for b in range(3):
        check(reference, same_records, list(range(8)), x, batch_index=b, min_score=0.0)
    route = RNG.random((2, 5, 4))
    with pytest.raises(ShapeError, match="batch_index"):
        extract(list(range(5)), route, ExtractionConfig(score_type="route"))
    check(reference, same_records, list(range(5)), route, score_type="route", batch_index=1, min_score=0.0)
    with pytest.raises(ShapeError, match="out of range"):
        extract(list(range(8)), x, ExtractionConfig(batch_index=3))
    with pytest.raises(ShapeError, match="no batch axis"):
        extract(list(range(8)), x[0], ExtractionConfig(batch_index=1))
    with pytest.raises(ShapeError, match="no batch axis"):
        extract(list(range(5)), route[0], ExtractionConfig(score_type="route", batch_index=1))
    assert extract(list(range(8)), x[1], ExtractionConfig(batch_index=0)) == extract(
        list(range(8)), x[1], ExtractionConfig()
    )


def test_token_offset_shifts_positions(reference, same_records):
    ids = [1] + list(range(200, 210))  # a BOS the matrix does not hold
    x = attention(1, 2, 3, 10, seed=23)
    got = check(reference, same_records, ids, x, token_offset=1, min_score=0.0, top_k=10)
    assert sorted(r.position for r in got) == list(range(1, 11))
    assert all(r.token_id == ids[r.position] for r in got)


def test_alignment_with_prompt_only_and_token_types(reference, same_records):
    ids = list(range(50, 62))  # 8 prompt + 4 generated
    got = check(reference, same_records, ids, attention(1, 1, 2, 12, seed=25), prompt_len=8, min_score=0.0, top_k=12)
    assert {r.token_type for r in got} == {"prompt", "generated"}
    assert all((r.token_type == "prompt") == (r.position < 8) for r in got)
    prompt_only = check(
        reference, same_records, ids, attention(1, 1, 2, 8, seed=26), prompt_len=8, min_score=0.0, top_k=12
    )
    assert max(r.position for r in prompt_only) == 7 and all(r.token_type == "prompt" for r in prompt_only)


def test_alignment_error_names_both_lengths_and_the_layout():
    ids = list(range(12))
    with pytest.raises(AlignmentError) as info:
        extract(ids, np.ones((2, 3, 10)), ExtractionConfig(layout="hkq"), prompt_len=9)
    message = str(info.value)
    assert "3 tokens" in message and "'hkq'" in message and "12" in message and "9 (prompt" in message
    with pytest.raises(AlignmentError, match=r"minus token_offset 2"):
        extract(ids, np.ones((1, 11)), ExtractionConfig(token_offset=2))
    with pytest.raises(AlignmentError, match=r"\[tokens, experts\]"):
        extract(ids, np.ones((5, 4)), ExtractionConfig(score_type="route"))


def test_exclude_special_drops_special_tokens_and_renormalizes(reference, same_records):
    ids = [0, 5, 6, 7, 2, 8]  # 0 and 2 are special
    scores = np.array([[10.0, 1.0, 2.0, 3.0, 9.0, 0.5]])
    cfg = dict(layout="qk", exclude_special=True, special_ids=(0, 2), min_score=0.0)
    got = check(reference, same_records, ids, scores, **cfg)
    assert [r.position for r in got] == [3, 2, 1, 5]
    assert got[0].score == 1.0  # relative to the best token that is not special
    kept = extract(ids, scores, ExtractionConfig(layout="qk", special_ids=(0, 2), min_score=0.0))
    assert [r.token_type for r in kept[:2]] == ["special", "special"]
    tensor_ids = extract(torch.tensor(ids), scores, ExtractionConfig(**cfg))
    assert [r.to_dict() for r in tensor_ids] == [r.to_dict() for r in got]


def test_decode_failures_are_counted_and_leave_text_none():
    def flaky(token_id: int) -> str:
        if token_id % 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return f"<{token_id}>"

    result = extract_detailed(
        list(range(8)), np.arange(1, 9, dtype=float)[None], ExtractionConfig(layout="qk", min_score=0.0), flaky
    )
    assert result.decode_failures == 4
    assert all((r.text is None) == bool(r.token_id % 2) for r in result.records)
    assert all(r.text == f"<{r.token_id}>" for r in result.records if r.text is not None)
    wrong_type = extract_detailed([1, 2], np.ones((1, 2)), ExtractionConfig(layout="qk"), lambda t: t)
    assert wrong_type.decode_failures == 2


def test_layer_and_step_are_copied():
    got = extract([1, 2, 3], np.ones((1, 3)), ExtractionConfig(layout="qk"), layer=7, step=4)
    assert {(r.layer, r.step) for r in got} == {(7, 4)}


def test_numpy_and_torch_and_float16_agree():
    x = attention(1, 3, 4, 20, seed=29).astype(np.float32)
    ids = list(range(20))
    cfg = ExtractionConfig(min_score=0.0)
    a = extract(ids, x, cfg)
    b = extract(torch.arange(20), torch.from_numpy(x), cfg)
    c = extract(np.array(ids), torch.from_numpy(x).half(), cfg)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    assert [r.score for r in c] == pytest.approx([r.score for r in a], rel=5e-3)
    assert x.flags.writeable  # the input is not modified
    readonly = x.copy()
    readonly.flags.writeable = False
    assert [r.to_dict() for r in extract(ids, readonly, cfg)] == [r.to_dict() for r in a]


def test_engine_shapes_qk_row_and_hqk_decode_step(reference, same_records):
    ids = torch.arange(300, 340)
    check(reference, same_records, ids.tolist(), attention(1, 1, 1, 40, seed=31)[0, 0], layout="qk")
    check(reference, same_records, ids.tolist(), attention(1, 9, 1, 40, seed=32)[0], layout="hqk")
    got = extract(ids, torch.from_numpy(attention(1, 9, 1, 40, seed=32)[0]), ExtractionConfig(layout="hqk"), layer=3)
    assert got and all(r.layer == 3 and r.token_id == 300 + r.position for r in got)


def test_empty_signal_gives_no_records():
    assert extract([], np.zeros((2, 0)), ExtractionConfig(layout="qk")) == []
    assert extract([1], np.zeros((1, 1, 0)), ExtractionConfig(token_offset=1)) == []


@pytest.mark.parametrize("shape", [(5,), (1, 1, 1, 1, 5)])
def test_rank_1_or_5_is_a_shape_error(shape):
    with pytest.raises(ShapeError, match=r"5-D|1-D"):
        extract(list(range(5)), np.ones(shape), ExtractionConfig())


def test_wrong_rank_for_the_layout_or_score_type():
    with pytest.raises(ShapeError, match=r"layout 'bhqk' needs 4-D"):
        extract(list(range(5)), np.ones((2, 5, 5)), ExtractionConfig(layout="bhqk"))
    with pytest.raises(ShapeError, match=r"route scores must be 2-D"):
        extract(list(range(5)), np.ones((1, 1, 5, 4)), ExtractionConfig(score_type="route"))
    with pytest.raises(ShapeError, match=r"empty hidden axis"):
        extract(list(range(5)), np.ones((5, 0)), ExtractionConfig(score_type="activation"))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"query_reduce": "max", "head_reduce": "max"},
        {"query_reduce": "last"},
        {"head_reduce": "none"},
        {"exclude_special": True, "special_ids": (0,)},
    ],
)
def test_nan_and_inf_are_refused_whatever_the_reduction(bad, cfg):
    x = attention(1, 3, 4, 6, seed=33)
    x[0, 1, 0, 2] = bad  # not in the last query row, next to finite values in the max reductions
    with pytest.raises(ShapeError, match="NaN or infinite"):
        extract(list(range(6)), x, ExtractionConfig(**cfg))
    with pytest.raises(ShapeError, match="NaN or infinite"):
        extract(list(range(6)), torch.from_numpy(x).float(), ExtractionConfig(**cfg))


@pytest.mark.parametrize(
    "cfg",
    [
        {"score_type": "route"},
        {"score_type": "route", "route_input": "logits"},
        {"score_type": "activation"},
        {"score_type": "activation", "activation_reduce": "l2"},
        {"score_type": "activation", "activation_reduce": "nonzero_frac"},
    ],
)
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_nan_and_inf_refused_in_route_and_activation(cfg, bad):
    x = np.full((4, 3), 0.2)
    x[2, 1] = bad
    with pytest.raises(ShapeError, match="NaN or infinite"):
        extract(list(range(4)), x, ExtractionConfig(**cfg))


def test_overflowing_sum_of_finite_values_is_not_mistaken_for_inf():
    x = np.full((1, 1, 4, 3), 3e38, dtype=np.float32)
    x[..., 1] = 1e38
    with pytest.raises(ShapeError, match="overflow"):
        extract([1, 2, 3], x, ExtractionConfig())  # the per-token sums themselves overflow float32
    got = extract([1, 2, 3], x, ExtractionConfig(query_reduce="max"))
    assert [r.position for r in got] == [0, 2, 1]


def test_bad_arguments_are_typed_errors():
    x = np.ones((1, 3))
    with pytest.raises(ConfigError, match="ExtractionConfig"):
        extract([1, 2, 3], x, {"layout": "qk"})  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="NumPy array or a torch tensor"):
        extract([1, 2, 3], [[1.0, 2.0, 3.0]], ExtractionConfig())  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="real numbers"):
        extract([1, 2, 3], np.array([["a", "b", "c"]]), ExtractionConfig())
    with pytest.raises(ShapeError, match="1-D integers"):
        extract(np.ones(3), x, ExtractionConfig())
    with pytest.raises(ShapeError, match="must be ints"):
        extract([1, "b", 3], x, ExtractionConfig(min_score=0.0))
    with pytest.raises(AlignmentError, match="prompt_len"):
        extract([1, 2, 3], x, ExtractionConfig(), prompt_len=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tensor_matches_cpu():
    x = torch.from_numpy(attention(1, 9, 7, 300, seed=35)).float()
    ids = torch.arange(300)
    cfg = ExtractionConfig(head_reduce="none", min_score=0.0)
    cpu = extract(ids, x, cfg)
    gpu = extract(ids.cuda(), x.cuda(), cfg)
    assert [(r.position, r.head, r.rank) for r in gpu] == [(r.position, r.head, r.rank) for r in cpu]
    assert [r.score for r in gpu] == pytest.approx([r.score for r in cpu], rel=1e-5)
