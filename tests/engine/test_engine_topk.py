"""``topk_attention``: decode steps attend only to the top-k keys; nothing is deleted; skipped keys are counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import KV_HEADS, prompt_ids, run

from sparseety.engine.attention import topk_attention
from sparseety.policies import build_policy

PROMPT, NEW, K = 20, 10, 24


def last_logits(engine, ids, policy, new, **kwargs):
    """Run and capture the last-position logits of every forward."""
    captured: list[torch.Tensor] = []
    handle = engine.model.lm_head.register_forward_hook(lambda m, a, out: captured.append(out[0, -1].clone()))
    try:
        result = run(engine, ids, policy, new, **kwargs)
    finally:
        handle.remove()
    return result, captured


def test_outputs_differ_from_dense_only_once_context_exceeds_k(engine_for):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    dense, dense_logits = last_logits(engine, ids, build_policy("dense"), NEW, tier=2)
    topk, topk_logits = last_logits(engine, ids, build_policy("topk_attention", K), NEW, tier=2)
    assert len(dense_logits) == len(topk_logits) == NEW
    for forward in range(NEW):
        n = PROMPT + forward  # keys visible to the query of this forward
        if n <= K:
            assert torch.equal(topk_logits[forward], dense_logits[forward]), f"forward {forward}, n={n} <= k"
        else:
            assert not torch.allclose(topk_logits[forward], dense_logits[forward]), f"forward {forward}, n={n} > k"
            break
    first_sparse = K - PROMPT + 1
    assert topk.output_ids[:first_sparse] == dense.output_ids[:first_sparse]


def test_skipped_counts_per_layer_per_decode_step(engine_for):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    k = 12
    result = run(engine, ids, build_policy("topk_attention", k), NEW, tier=3)
    a = result.arrays
    expected_total = 0
    for step in range(1, NEW):  # decode steps; the prefill is dense
        n = PROMPT + step
        expected_total += (n - k) * KV_HEADS * engine.num_layers
        for layer in range(engine.num_layers):
            for head in range(KV_HEADS):
                sel = lambda kind: (a[f"{kind}.step"] == step) & (a[f"{kind}.layer"] == layer) & (a[f"{kind}.kv_head"] == head)
                skipped = a["skipped.position"][sel("skipped")]
                attended = a["attended.position"][sel("attended")]
                assert skipped.size == n - k and attended.size == k
                assert sorted(skipped.tolist() + attended.tolist()) == list(range(n))
    assert result.skipped_events == expected_total
    assert not (a["skipped.step"] == 0).any() and not (a["attended.step"] == 0).any()
    assert result.eviction_events == 0
    for heads in result.kept_positions_final.values():  # nothing deleted
        assert all(kept == list(range(PROMPT + NEW - 1)) for kept in heads.values())


def test_skipped_count_is_recorded_at_tier_1(engine_for):
    engine = engine_for("qwen2")
    result = run(engine, prompt_ids(PROMPT), build_policy("topk_attention", 12), NEW, tier=1)
    assert result.skipped_events == sum((PROMPT + s - 12) for s in range(1, NEW)) * KV_HEADS * engine.num_layers


def test_topk_attention_matches_masked_attention():
    torch.manual_seed(0)
    b, heads, kvh, n, d, k = 1, 4, 2, 9, 8, 4
    query = torch.randn(b, heads, 1, d)
    key = torch.randn(b, kvh, n, d)
    value = torch.randn(b, kvh, n, d)
    scale = d ** -0.5
    out, attended, skipped, probs = topk_attention(query, key, value, scale, k)
    logits = torch.einsum("bkgd,bknd->bkgn", query.reshape(b, kvh, heads // kvh, d), key) * scale
    top = logits.sum(dim=2).topk(k, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(attended.nonzero()[:, -1].reshape(b, kvh, k), top)
    assert skipped == (n - k) * kvh
    mask = torch.full_like(logits, float("-inf")).scatter(-1, top[:, :, None, :].expand(b, kvh, heads // kvh, k), 0.0)
    expected_probs = torch.softmax(logits + mask, dim=-1)
    expected = torch.einsum("bkgn,bknd->bkgd", expected_probs, value).reshape(b, heads, d)
    assert torch.allclose(out[:, 0], expected, atol=1e-5)
    assert torch.allclose(probs, expected_probs.reshape(b, heads, n), atol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(b, heads))


def test_topk_attention_ties_go_to_lower_slot():
    query = torch.ones(1, 2, 1, 4)
    key = torch.ones(1, 1, 6, 4)  # every key scores the same
    _, attended, _, _ = topk_attention(query, key, torch.randn(1, 1, 6, 4), 0.5, 3)
    assert attended.tolist() == [[[True, True, True, False, False, False]]]


def test_topk_attention_verify_rows_equal_one_row_at_a_time():
    """A draft-verify step with q rows must give each row what a one-token decode step gives it."""
    torch.manual_seed(1)
    heads, kvh, n, d, k, q = 4, 2, 12, 8, 5, 3
    query, key, value = torch.randn(1, heads, q, d), torch.randn(1, kvh, n, d), torch.randn(1, kvh, n, d)
    out, _, skipped, _ = topk_attention(query, key, value, 0.3, k)
    total = 0
    for row in range(q):
        visible = n - q + row + 1
        one, _, row_skipped, _ = topk_attention(query[:, :, row : row + 1], key[:, :, :visible], value[:, :, :visible], 0.3, k)
        assert torch.allclose(out[:, row], one[:, 0], atol=1e-6)
        total += row_skipped
    assert skipped == total


@pytest.mark.parametrize("k", [PROMPT + NEW - 1, PROMPT + NEW + 5])
def test_k_covering_the_context_equals_dense(k, engine_for, greedy_reference):
    ids = prompt_ids(PROMPT)
    result = run(engine_for("mixtral"), ids, build_policy("topk_attention", k), NEW, tier=3)
    assert result.output_ids == greedy_reference("mixtral", ids, NEW)
    assert result.skipped_events == 0 and "skipped.position" not in result.arrays
    assert np.isfinite(result.arrays["importance"]).all()


def test_attention_topk_on_dense_is_the_topk_policy(engine_for):
    """``attention_topk=k`` under the dense policy is exactly the ``topk_attention`` policy with budget k."""
    engine, ids = engine_for("qwen2"), prompt_ids(PROMPT, seed=5)
    policy_run = run(engine, ids, build_policy("topk_attention", 12), NEW, tier=2)
    composed = run(engine, ids, build_policy("dense"), NEW, tier=2, attention_topk=12)
    assert composed.output_ids == policy_run.output_ids
    assert composed.skipped_events == policy_run.skipped_events > 0
    for column in ("step", "layer", "kv_head", "position"):
        assert np.array_equal(composed.arrays[f"attended.{column}"], policy_run.arrays[f"attended.{column}"])


def test_attention_topk_composes_with_eviction(engine_for):
    """Under H2O the cache still holds its budget, and each decode step attends to at most k held slots."""
    engine, ids, budget, k = engine_for("llama"), prompt_ids(PROMPT, seed=6), 16, 6
    result = run(engine, ids, build_policy("h2o", budget), NEW, tier=2, attention_topk=k)
    assert result.eviction_events > 0 and result.skipped_events > 0
    a = result.arrays
    keys = np.stack([a["attended.step"], a["attended.layer"], a["attended.kv_head"]], axis=1)
    _, counts = np.unique(keys, axis=0, return_counts=True)
    assert counts.max() == k
    for layer, heads in result.kept_positions_final.items():
        assert all(len(p) <= budget for p in heads.values())


@pytest.mark.parametrize(("policy", "k", "message"), [
    ("dense", 0, "attention_topk must be a positive number of slots, got 0"),
    ("topk_attention", 4, "already attends to its top"),
])
def test_attention_topk_bad_values(engine_for, policy, k, message):
    from sparseety.errors import InputError

    with pytest.raises(InputError, match=message):
        run(engine_for("llama"), prompt_ids(PROMPT), build_policy(policy, 8 if policy != "dense" else None), 2,
            attention_topk=k)
