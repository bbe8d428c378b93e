"""``smollm2-moe``: the default model upcycled into a Mixtral-layout MoE keeps SmolLM2's text, with real routing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from sparseety.engine import SparseEngine, encode_prompt
from sparseety.models import MOE_MODEL, list_models, load_model
from sparseety.models.upcycle import EXPERTS, TOP_K, kmeans_centroids
from sparseety.policies import build_policy

pytestmark = pytest.mark.model

#: Not the text the router centroids were placed on (a licence file): a prompt of another kind.
PROMPT = "List four tools a carpenter uses and say what each one is for."


@pytest.fixture(scope="module")
def moe():
    return load_model(MOE_MODEL)


def test_kmeans_finds_separated_directions_deterministically():
    generator = torch.Generator().manual_seed(0)
    axes = torch.eye(8)[:3] * 5
    points = torch.cat([axis + 0.1 * torch.randn(40, 8, generator=generator) for axis in axes])
    centroids = kmeans_centroids(points, 3)
    assert torch.equal(centroids, kmeans_centroids(points, 3))
    nearest = torch.argmax(centroids @ torch.eye(8)[:3].T, dim=1)
    assert sorted(nearest.tolist()) == [0, 1, 2]
    assert torch.allclose(centroids.norm(dim=1), torch.ones(3), atol=1e-5)


def test_listed_and_loaded_as_mixtral(moe):
    assert MOE_MODEL in [m.name for m in list_models()]
    model, _ = moe
    assert type(model).__name__ == "MixtralForCausalLM"
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (EXPERTS, TOP_K)


def test_greedy_text_equals_smollm2_in_the_own_engine(smollm, moe):
    model, tokenizer = moe
    encoded = encode_prompt(tokenizer, PROMPT, None)
    engine = SparseEngine(model, tokenizer, MOE_MODEL)
    routed = engine.generate(encoded, build_policy("dense"), max_new_tokens=24, tier=2)
    dense_model, _ = smollm
    with torch.inference_mode():
        reference = dense_model.generate(encoded.input_ids, max_new_tokens=24, do_sample=False)
    assert routed.output_ids == reference[0, encoded.input_len:].tolist()
    # The engine's router signals are the router's own probabilities, layer by layer (float16 in the trace).
    with torch.inference_mode():
        fed = torch.tensor([encoded.input_ids[0].tolist() + routed.output_ids[:-1]])
        logits = model(fed, output_router_logits=True).router_logits
    for layer in (0, 15, 29):
        expected = torch.softmax(logits[layer].float(), dim=-1).numpy()
        traced = routed.arrays[f"router.{layer}"].astype(np.float32)
        assert traced.shape == expected.shape == (fed.shape[1], EXPERTS)
        np.testing.assert_allclose(traced, expected, atol=2e-3)


def test_routing_depends_on_the_token_and_the_load_is_uneven(moe):
    model, tokenizer = moe
    ids = encode_prompt(tokenizer, PROMPT, None).input_ids
    with torch.inference_mode():
        logits = model(ids, output_router_logits=True).router_logits
    imbalance = []
    for layer_logits in logits:
        chosen = torch.topk(layer_logits, TOP_K, dim=-1).indices
        assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 1  # not one fixed pair for every token
        load = Counter(chosen.flatten().tolist())
        counts = np.array([load.get(e, 0) for e in range(EXPERTS)])
        imbalance.append(counts.max() / counts.mean())
    assert max(imbalance) > 1.5
