"""Probes: MoE router probabilities, MLP activation stats, and tier-3 per-step importance vectors.

Each recorded signal is checked against an independent computation on a never-wrapped twin model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import MOE_FAMILIES, build_model, kept_after_step, prompt_ids, run

from sparseety.policies import build_policy

PROMPT, NEW = 24, 8
SEEN = PROMPT + NEW - 1


def _routers(model):
    return {int(name.split("layers.")[1].split(".")[0]): module
            for name, module in model.named_modules() if type(module).__name__.endswith("TopKRouter")}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_probabilities_per_moe_layer(family, engine_for):
    engine = engine_for(family)
    routers = _routers(engine.model)
    assert sorted(routers) == list(range(engine.num_layers))
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in routers}
    handles = [module.register_forward_pre_hook(lambda m, args, layer=layer: captured[layer].append(args[0].detach()))
               for layer, module in routers.items()]
    try:
        result = run(engine, prompt_ids(PROMPT), build_policy("dense"), NEW, tier=2)
    finally:
        for handle in handles:
            handle.remove()
    experts = routers[0].weight.shape[0]
    for layer, module in routers.items():
        probs = result.arrays[f"router.{layer}"]
        assert probs.shape == (SEEN, experts)  # one row per token fed
        assert probs.dtype == np.float16
        assert np.allclose(probs.astype(np.float32).sum(axis=1), 1.0, atol=2e-3)
        hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h in captured[layer]])
        expected = torch.softmax(F.linear(hidden.float(), module.weight.detach().float()), dim=-1).numpy()
        assert np.allclose(probs.astype(np.float32), expected, atol=1e-3)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_probes_only_from_tier_2(family, engine_for):
    engine = engine_for(family)
    for tier in (0, 1):
        result = run(engine, prompt_ids(PROMPT), build_policy("dense"), NEW, tier=tier)
        assert not any(key.startswith("router.") for key in result.arrays)
    result = run(engine, prompt_ids(PROMPT), build_policy("h2o", 8), NEW, tier=3)
    assert result.arrays["router.0"].shape[0] == SEEN  # eviction does not change what is fed


def test_router_hooks_are_removed_after_the_run(engine_for):
    engine = engine_for("mixtral")
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.model.modules())
    run(engine, prompt_ids(PROMPT), build_policy("dense"), 2, tier=3)
    after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.model.modules())
    assert after == before


def test_activation_stats_match_the_mlp_input(engine_for):
    engine = engine_for("llama")
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(engine.num_layers)}
    handles = [engine.model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(
        lambda m, args, layer=layer: captured[layer].append(args[0].detach())) for layer in captured]
    try:
        result = run(engine, prompt_ids(PROMPT), build_policy("dense"), NEW, tier=2)
    finally:
        for handle in handles:
            handle.remove()
    maxabs = result.arrays["activation.maxabs"]
    assert maxabs.shape == (engine.num_layers, SEEN)
    for layer, chunks in captured.items():
        x = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks]).abs()
        assert np.allclose(maxabs[layer].astype(np.float32), x.amax(dim=-1).numpy(), rtol=1e-3, atol=1e-4)
        zero = (x < 1e-3).float().mean(dim=-1).numpy()
        assert np.allclose(result.arrays["activation.zero_frac"][layer].astype(np.float32), zero, atol=1e-3)


def _eager_last_rows(token_ids: list[int], forwards: int) -> list[np.ndarray]:
    """Per forward ``s``: ``[layers, P + s]`` attention of the query that produced output ``s``,
    averaged over query heads, from a plain eager model that outputs its attention matrices."""
    model = build_model("llama")
    model.set_attn_implementation("eager")
    rows = []
    with torch.inference_mode():
        for s in range(forwards):
            ids = torch.tensor([token_ids[: PROMPT + s]])
            attentions = model(ids, output_attentions=True).attentions
            rows.append(np.stack([a[0, :, -1, :].mean(dim=0).float().numpy() for a in attentions]))
    return rows


def test_tier3_step_importance_is_the_attention_of_each_step(engine_for):
    engine = engine_for("llama")
    result = run(engine, prompt_ids(PROMPT), build_policy("dense"), NEW, tier=3, importance="attention")
    steps = result.arrays["step_importance"]
    assert steps.dtype == np.float16
    assert steps.shape == (NEW, engine.num_layers, SEEN)  # one vector per forward, as wide as the cache got
    expected = _eager_last_rows(result.token_ids, NEW)
    for s in range(NEW):
        width = PROMPT + s
        row = steps[s, :, :width].astype(np.float32)
        assert np.isfinite(row).all() and (row >= 0).all()
        assert np.allclose(row.sum(axis=1), 1.0, atol=1e-2)
        assert np.isnan(steps[s, :, width:]).all()  # padding beyond what that step saw
        assert np.allclose(row, expected[s], atol=2e-3), f"step {s}"
    importance = result.arrays["importance"].astype(np.float32)
    assert importance.shape == (engine.num_layers, SEEN)
    assert np.allclose(importance, np.nansum(steps.astype(np.float32), axis=0), atol=1e-2)
    assert np.allclose(importance.sum(axis=1), NEW, atol=5e-2)


def test_tier3_evicted_positions_get_no_importance(engine_for):
    engine = engine_for("llama")
    budget = 10
    result = run(engine, prompt_ids(PROMPT), build_policy("streaming", budget), NEW, tier=3, importance="attention")
    steps = result.arrays["step_importance"].astype(np.float32)
    for s in range(1, NEW):
        seen = PROMPT + s
        for layer in range(engine.num_layers):
            held = kept_after_step(result, layer, 0, s - 1, seen - 1) | {seen - 1}  # streaming: same in every head
            row = steps[s, layer, :seen]
            assert (row[sorted(set(range(seen)) - held)] == 0).all()
            assert row[sorted(held)].sum() == pytest.approx(1.0, abs=1e-2)
