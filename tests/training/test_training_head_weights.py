"""``--importance learned``'s fit (:mod:`sparseety.training.head_weights`): its features are the engine's own
scores, and the fit recovers weights that explain the drops. The engine's use of the weights and the file:
``tests/engine/test_engine_learned_importance.py``; the command: ``tests/cli/test_learn_importance_cmd.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_model, build_tokenizer, prompt_ids

from sparseety.engine import EncodedInput, SparseEngine
from sparseety.extract.head_weights import HeadWeights
from sparseety.policies import build_policy
from sparseety.training.head_weights import TrainingPrompt, fit_weights, head_features, mean_correlation

NEW = 5


@pytest.fixture(scope="module")
def engine_for():
    """``engine_for(family)``: one wrapped tiny engine per family for this module."""
    engines: dict[str, SparseEngine] = {}

    def get(family: str) -> SparseEngine:
        if family not in engines:
            engines[family] = SparseEngine(build_model(family), build_tokenizer(), model_name=f"tiny-{family}")
        return engines[family]

    return get


def weights_for(engine, feature: str, seed: int = 0) -> HeadWeights:
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(engine.num_layers, engine.num_heads, generator=generator) * 2
    values[0, 1] = 0.0  # a head switched off
    return HeadWeights(values, feature, engine.model_name, engine.model_info.fingerprint())


def test_training_features_are_the_engines_scores(engine_for):
    engine = engine_for("llama")
    weights = weights_for(engine, "output", seed=3)
    prompt = prompt_ids(18, seed=6)[0].tolist()
    result = engine.generate(EncodedInput(torch.tensor([prompt])), build_policy("dense"), max_new_tokens=NEW,
                             importance="learned", importance_weights=weights)
    features = head_features(engine, prompt, result.output_ids, "output")  # [layers, heads, n]
    assert features.shape == (engine.num_layers, engine.num_heads, 18)
    predicted = (features * weights.weights.unsqueeze(-1)).sum(dim=1) / engine.num_heads
    np.testing.assert_allclose(result.arrays["importance"][:, :18].astype(np.float64), predicted.double().numpy(),
                               rtol=2e-3, atol=1e-4)


def test_fit_recovers_weights_that_explain_the_drops():
    """Drops made by known non-negative weights: the fit predicts them (correlation ~1), uniform weights do not."""
    generator = torch.Generator().manual_seed(0)
    truth = torch.zeros(3, 4)
    truth[1, 2], truth[2, 0] = 3.0, 1.0
    prompts = []
    for _ in range(4):
        features = torch.rand(3, 4, 12, generator=generator)
        masks = (torch.rand(40, 12, generator=generator) < 0.2).float()
        drops = masks @ (features * truth.unsqueeze(-1)).sum(dim=(0, 1))
        prompts.append(TrainingPrompt("p", features, masks, drops))
    fitted = fit_weights(prompts, steps=300)
    assert bool((fitted >= 0).all()) and float(fitted.mean()) == pytest.approx(1.0)
    assert mean_correlation(prompts, fitted) > 0.99 > mean_correlation(prompts, torch.ones(3, 4)) + 0.05
