"""The bypass changes nothing: the dense policy reproduces plain transformers greedy generation.

DESIGN.md: "with the dense policy and every probe on, the generated tokens equal plain transformers
greedy generation, token for token" — checked at every tier, for a Llama, a Qwen2 and two MoE families.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, HEAD_DIM, KV_HEADS, build_model, prompt_ids, run

from sparseety.engine import EncodedInput, SparseEngine
from sparseety.policies import build_policy

PROMPT, NEW = 40, 12


@pytest.mark.parametrize("tier", [0, 1, 2, 3])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_equals_plain_greedy(family, tier, engine_for, greedy_reference):
    ids = prompt_ids(PROMPT)
    expected = greedy_reference(family, ids, NEW)
    assert len(expected) == NEW
    result = run(engine_for(family), ids, build_policy("dense"), NEW, tier=tier)
    assert result.output_ids == expected
    assert result.prompt_ids == ids[0].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_equals_plain_greedy_on_other_prompts(family, engine_for, greedy_reference):
    for n, seed in ((1, 3), (7, 4), (130, 5)):  # a one-token prompt, a short one, one over the SDPA block size
        ids = prompt_ids(n, seed=seed)
        result = run(engine_for(family), ids, build_policy("dense"), 6, tier=3)
        assert result.output_ids == greedy_reference(family, ids, 6), f"prompt of {n} tokens"


def test_dense_keeps_everything_and_memory_is_dense(engine_for):
    engine = engine_for("llama")
    result = run(engine, prompt_ids(PROMPT), build_policy("dense"), NEW, tier=2)
    seen = PROMPT + NEW - 1  # the last generated token is never fed back
    assert result.eviction_events == 0 and result.evicted_positions == 0
    assert "evicted.position" not in result.arrays
    assert set(result.kept_positions_final) == {str(layer) for layer in range(engine.num_layers)}
    for heads in result.kept_positions_final.values():
        assert set(heads) == {str(h) for h in range(KV_HEADS)}
        for positions in heads.values():
            assert positions == list(range(seen))
    dense = 2 * engine.num_layers * KV_HEADS * seen * HEAD_DIM * 4
    assert result.kv_cache_bytes_dense == dense
    assert result.kv_cache_bytes_peak == dense


def test_engine_honours_the_models_eos(tokenizer, greedy_reference):
    """An eos in the model's generation config stops the engine exactly where it stops plain generate."""
    ids = prompt_ids(PROMPT)
    free = greedy_reference("llama", ids, NEW)
    stop_at = next(i for i in range(2, NEW) if free[i] not in free[:i])
    eos = free[stop_at]
    reference = build_model("llama")
    reference.generation_config.eos_token_id = eos
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                      do_sample=False)[0, PROMPT:].tolist()
    assert expected == free[: stop_at + 1]
    model = build_model("llama")
    model.generation_config.eos_token_id = eos
    result = SparseEngine(model, tokenizer).generate(EncodedInput(ids), build_policy("dense"),
                                                     max_new_tokens=NEW, tier=2)
    assert result.output_ids == expected


def test_tier_contents(engine_for):
    """Tier 0 records nothing, tier 1 counts, tier 2 token lists and kept positions, tier 3 per-step vectors."""
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    policy = build_policy("streaming", 16)
    by_tier = {tier: run(engine, ids, policy, NEW, tier=tier) for tier in range(4)}
    outputs = {tuple(r.output_ids) for r in by_tier.values()}
    assert len(outputs) == 1, "the tier must not change the generated tokens"
    t0, t1, t2, t3 = (by_tier[t] for t in range(4))
    assert t0.arrays == {} and t0.kept_positions_final is None and t0.eviction_events is None
    assert t1.eviction_events == t2.eviction_events == t3.eviction_events > 0
    assert t1.kept_positions_final is None and "importance" not in t1.arrays
    assert "evicted.position" in t1.arrays
    assert t2.kept_positions_final is not None and "importance" in t2.arrays
    assert "step_importance" not in t2.arrays and "step_importance" in t3.arrays
    assert all(t.kv_cache_bytes_peak == t0.kv_cache_bytes_peak for t in by_tier.values())
