"""Budgets hold: no layer/head ever holds more than its budget, evicted + kept = seen, memory follows the budget.

Per-step kept sets are reconstructed from the eviction log: after the forward of step ``s`` (step 0 is
the prefill) the cache has seen ``P + s`` tokens, and a (layer, kv_head) holds every one of them except
those evicted at steps ``<= s``.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import (
    HEAD_DIM,
    KV_HEADS,
    evicted_by_head,
    kept_after_step,
    prompt_ids,
    run,
)

from sparseety.policies import build_policy

PROMPT, NEW, BUDGET = 40, 10, 16
SEEN = PROMPT + NEW - 1

EVICTING = [
    ("streaming", {}),
    ("streaming", {"sinks": "0"}),
    ("h2o", {}),
    ("h2o", {"prefill_rows": "8"}),  # prefill column sums from every 5th row
    ("snapkv", {"window": "4"}),
    ("snapkv", {}),  # default window 32 > budget: the protected window is clipped to the budget
    ("tova", {}),
    ("knorm", {}),
    ("random", {}),
    ("pyramid", {"window": "4", "beta": "4"}),
]
UNIFORM = [(name, opts) for name, opts in EVICTING if name != "pyramid"]
ALL_SPARSE = EVICTING + [("topk_attention", {})]


def _id(param):
    name, opts = param
    return name + "".join(f"-{k}{v}" for k, v in opts.items())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe"])
@pytest.mark.parametrize("policy", ALL_SPARSE, ids=_id)
def test_budget_covering_the_sequence_equals_dense(policy, family, engine_for, greedy_reference):
    """A budget of at least the sequence length evicts nothing and changes no token."""
    name, opts = policy
    ids = prompt_ids(PROMPT)
    expected = greedy_reference(family, ids, NEW)
    result = run(engine_for(family), ids, build_policy(name, PROMPT + NEW, opts), NEW, tier=2)
    assert result.output_ids == expected
    assert result.eviction_events == 0 and result.skipped_events == 0
    for heads in result.kept_positions_final.values():
        assert all(kept == list(range(SEEN)) for kept in heads.values())


@pytest.mark.parametrize("policy", UNIFORM + [("topk_attention", {})], ids=_id)
def test_budget_equal_to_tokens_seen_is_the_boundary(policy, engine_for, greedy_reference):
    """Budget == tokens the cache ever sees (P + G - 1): nothing evicted, nothing skipped, same tokens."""
    name, opts = policy
    ids = prompt_ids(PROMPT)
    result = run(engine_for("llama"), ids, build_policy(name, SEEN, opts), NEW, tier=2)
    assert result.output_ids == greedy_reference("llama", ids, NEW)
    assert result.eviction_events == 0 and result.skipped_events == 0


@pytest.mark.parametrize("policy", UNIFORM, ids=_id)
def test_eviction_happens_after_the_steps_attention(policy, engine_for, greedy_reference):
    """Budget P + G - 2: the last step evicts exactly one slot per layer/head, after its attention,
    so every query still saw every key and the tokens equal dense."""
    name, opts = policy
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    result = run(engine, ids, build_policy(name, SEEN - 1, opts), NEW, tier=2)
    assert result.output_ids == greedy_reference("llama", ids, NEW)
    a = result.arrays
    assert result.eviction_events == engine.num_layers * KV_HEADS
    assert set(a["evicted.step"].tolist()) == {NEW - 1}
    pairs = sorted(zip(a["evicted.layer"].tolist(), a["evicted.kv_head"].tolist()))
    assert pairs == [(layer, h) for layer in range(engine.num_layers) for h in range(KV_HEADS)]


def _layer_budgets(policy, num_layers):
    return [policy.layer_budget(layer, num_layers) for layer in range(num_layers)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("policy", EVICTING, ids=_id)
def test_budget_holds_after_every_step(policy, family, engine_for):
    name, opts = policy
    engine, ids = engine_for(family), prompt_ids(PROMPT)
    pol = build_policy(name, BUDGET, opts)
    budgets = _layer_budgets(pol, engine.num_layers)
    result = run(engine, ids, pol, NEW, tier=2)
    a = result.arrays
    token_ids = np.asarray(result.token_ids)
    assert len(result.output_ids) == NEW
    assert result.eviction_events == a["evicted.position"].size
    assert result.evicted_positions == np.unique(a["evicted.position"]).size
    assert np.array_equal(a["evicted.token_id"], token_ids[a["evicted.position"]])
    assert np.isfinite(a["evicted.score"]).all(), "a protected (+inf) slot was evicted"
    assert set(a["evicted.step"].tolist()) <= set(range(NEW))
    for layer in range(engine.num_layers):
        budget = budgets[layer]
        for head in range(KV_HEADS):
            positions, steps = evicted_by_head(result, layer, head)
            assert len(set(positions.tolist())) == positions.size, "a position was evicted twice"
            for step in range(NEW):
                seen = PROMPT + step
                assert (positions[steps == step] < seen).all(), "evicted a position not seen yet"
                # prefill drops P - budget slots at once; every later step exactly the one new slot too many
                expected_evictions = max(0, PROMPT - budget) if step == 0 else int(seen > budget)
                assert (steps == step).sum() == expected_evictions, (layer, head, step)
                assert len(kept_after_step(result, layer, head, step, seen)) == min(budget, seen)
            kept = result.kept_positions_final[str(layer)][str(head)]
            assert kept == sorted(kept_after_step(result, layer, head, NEW - 1, SEEN))
            assert not set(kept) & set(positions.tolist())
            assert len(kept) + positions.size == SEEN


def test_pyramid_budgets_shrink_with_depth(engine_for):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    pol = build_policy("pyramid", BUDGET, {"window": "4", "beta": "4"})
    budgets = _layer_budgets(pol, engine.num_layers)
    assert all(a > b for a, b in zip(budgets, budgets[1:])), budgets
    assert budgets[-1] == 4  # max(window, budget // beta)
    assert abs(sum(budgets) / len(budgets) - BUDGET) <= 0.5  # the mean is the budget
    result = run(engine, ids, pol, NEW, tier=2)
    for layer, heads in result.kept_positions_final.items():
        assert all(len(kept) == budgets[int(layer)] for kept in heads.values())
    per_layer = np.bincount(result.arrays["evicted.layer"], minlength=engine.num_layers)
    assert (np.diff(per_layer) > 0).all(), "deeper layers keep less, so they evict more"
    assert result.kv_cache_bytes_peak == 2 * KV_HEADS * HEAD_DIM * 4 * sum(budgets)


@pytest.mark.parametrize("policy", UNIFORM, ids=_id)
def test_memory_follows_the_budget(policy, engine_for):
    """Peak KV bytes, measured from the cache tensors, equal a full budget in every layer (float32)."""
    name, opts = policy
    engine = engine_for("llama")
    result = run(engine, prompt_ids(PROMPT), build_policy(name, BUDGET, opts), NEW, tier=1)
    assert result.kv_cache_bytes_peak == 2 * engine.num_layers * KV_HEADS * BUDGET * HEAD_DIM * 4
    assert result.kv_cache_bytes_dense == 2 * engine.num_layers * KV_HEADS * SEEN * HEAD_DIM * 4


def test_memory_of_a_non_evicting_policy_is_dense(engine_for):
    result = run(engine_for("llama"), prompt_ids(PROMPT), build_policy("topk_attention", 8), NEW, tier=1)
    assert result.kv_cache_bytes_peak == result.kv_cache_bytes_dense
    assert result.eviction_events == 0 and result.skipped_events > 0
