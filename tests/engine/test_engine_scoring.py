"""Which tokens a policy evicts at prefill, checked against attention recomputed by a plain eager model.

Prefill is computed densely in every layer (each layer evicts only after its own attention), so the
prefill attention of the wrapped model equals that of a never-wrapped eager twin.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import KV_HEADS, build_model, evicted_by_head, prompt_ids, run

from sparseety.policies import build_policy

PROMPT, BUDGET = 32, 12


@pytest.fixture(scope="module")
def eager_attention() -> list[np.ndarray]:
    """Per layer ``[kv_heads, P, P]`` prefill probabilities averaged over each KV group's query heads."""
    model = build_model("llama")
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = model(prompt_ids(PROMPT), output_attentions=True).attentions
    return [a[0].reshape(KV_HEADS, -1, PROMPT, PROMPT).mean(dim=1).float().numpy() for a in attentions]


def expected_evicted(scores: np.ndarray, protected: np.ndarray, budget: int) -> set[int]:
    """Drop all but the ``budget`` best slots; protected first; ties kept by the lower position."""
    scores = np.where(protected, np.inf, scores)
    order = sorted(range(scores.size), key=lambda i: (-scores[i], i))
    return set(order[budget:])


def recent(n: int, window: int) -> np.ndarray:
    return np.arange(n) >= n - window


def h2o_scores(attn: np.ndarray) -> np.ndarray:
    return attn.sum(axis=0)


def snapkv_scores(attn: np.ndarray, window: int = 4, kernel: int = 3) -> np.ndarray:
    votes = torch.from_numpy(attn[-window:].sum(axis=0)).reshape(1, 1, -1)
    return F.avg_pool1d(votes, kernel, stride=1, padding=kernel // 2, count_include_pad=False)[0, 0].numpy()


CASES = {
    "h2o": (build_policy("h2o", BUDGET, {"prefill_rows": 0}), h2o_scores, int(BUDGET * 0.5)),
    "snapkv": (build_policy("snapkv", BUDGET, {"window": 4, "kernel": 3}), snapkv_scores, 4),
    "tova": (build_policy("tova", BUDGET, {"heads": "kv_head"}), lambda attn: attn[-1], 0),
}


def test_tova_layer_mode_evicts_by_the_mean_over_all_heads(engine_for, eager_attention):
    engine = engine_for("llama")
    result = run(engine, prompt_ids(PROMPT), build_policy("tova", BUDGET), 2, tier=2)
    for layer in range(engine.num_layers):
        expected = expected_evicted(eager_attention[layer][:, -1].mean(axis=0), recent(PROMPT, 0), BUDGET)
        for head in range(KV_HEADS):
            positions, steps = evicted_by_head(result, layer, head)
            assert set(positions[steps == 0].tolist()) == expected, f"layer {layer} head {head}"


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_evictions_follow_the_attention_scores(name, engine_for, eager_attention):
    policy, score_of, window = CASES[name]
    engine = engine_for("llama")
    result = run(engine, prompt_ids(PROMPT), policy, 2, tier=2)
    for layer in range(engine.num_layers):
        for head in range(KV_HEADS):
            positions, steps = evicted_by_head(result, layer, head)
            scores = score_of(eager_attention[layer][head])
            expected = expected_evicted(scores, recent(PROMPT, window), BUDGET)
            assert set(positions[steps == 0].tolist()) == expected, f"layer {layer} head {head}"


def test_knorm_evicts_the_largest_keys(engine_for):
    """Keys are read from the cache's own k_proj + RoPE path via a hook on a twin model's attention."""
    engine = engine_for("llama")
    result = run(engine, prompt_ids(PROMPT), build_policy("knorm", BUDGET), 1, tier=2)
    twin = build_model("llama")
    with torch.inference_mode():
        cache = twin(prompt_ids(PROMPT), use_cache=True).past_key_values
    for layer in range(engine.num_layers):
        norms = cache.layers[layer].keys[0].float().norm(dim=-1).numpy()  # [kv_heads, P], RoPE applied
        for head in range(KV_HEADS):
            positions, _ = evicted_by_head(result, layer, head)
            assert set(positions.tolist()) == expected_evicted(-norms[head], np.zeros(PROMPT, bool), BUDGET)
