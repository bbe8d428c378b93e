"""``--importance learned``: per-(layer, head) weights at the hook point and the weights file.

The reference is the never-wrapped eager computation of ``test_engine_importance_modes`` with each
head's term multiplied by its weight. The fit and its features: ``tests/training/test_training_head_weights.py``.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from tiny_models import build_model, prompt_ids

from sparseety.engine import EncodedInput
from sparseety.errors import ConfigError
from sparseety.extract.head_weights import HeadWeights, read_head_weights
from sparseety.policies import build_policy

NEW = 5


def weighted_reference(family: str, sequence: list[int], prompt_len: int, feature: str,
                       weights: torch.Tensor) -> np.ndarray:
    """``[layers, seen]``: Σ over the emitting rows of (1 / heads) Σ_h w_lh · α_h · (1, ‖v‖ or ‖W_O^h v‖)."""
    model = build_model(family)
    model.set_attn_implementation("eager")
    ids = torch.tensor([sequence[:-1]])
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    seen = ids.shape[1]
    total = np.zeros((cfg.num_hidden_layers, seen))
    for layer, block in enumerate(model.model.layers):
        att = out.attentions[layer][0].double()
        with torch.no_grad():
            v = block.self_attn.v_proj(block.input_layernorm(out.hidden_states[layer]))[0]
        v = v.double().reshape(seen, kv_heads, d)
        w_o = block.self_attn.o_proj.weight.detach().double()
        for h in range(heads):
            vh = v[:, h // (heads // kv_heads)]
            norm = {"attention": torch.ones(seen, dtype=torch.float64), "value": vh.norm(dim=-1),
                    "output": (vh @ w_o[:, h * d : (h + 1) * d].T).norm(dim=-1)}[feature]
            for r in range(prompt_len - 1, seen):
                total[layer] += (att[h, r] * norm).numpy() * float(weights[layer, h]) / heads
    return total


def weights_for(engine, feature: str, seed: int = 0) -> HeadWeights:
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(engine.num_layers, engine.num_heads, generator=generator) * 2
    values[0, 1] = 0.0  # a head switched off
    return HeadWeights(values, feature, engine.model_name, engine.model_info.fingerprint())


@pytest.mark.parametrize("feature", ["attention", "value", "output"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_learned_scores_equal_the_weighted_eager_reference(engine_for, family, feature):
    engine = engine_for(family)
    weights = weights_for(engine, feature)
    result = engine.generate(EncodedInput(prompt_ids(20, seed=4)), build_policy("dense"), max_new_tokens=NEW,
                             importance="learned", importance_weights=weights)
    expected = weighted_reference(family, result.prompt_ids + result.output_ids, 20, feature, weights.weights)
    np.testing.assert_allclose(result.arrays["importance"].astype(np.float64), expected, rtol=2e-3, atol=1e-4)
    assert result.arrays["sink.position"][0] == 0
    extraction = result.provenance["extraction"]
    assert extraction["importance"] == "learned" and extraction["importance_feature"] == feature


def test_weights_file_round_trip_and_refusals(engine_for, tmp_path):
    engine = engine_for("llama")
    weights = weights_for(engine, "value")
    path = weights.save(tmp_path / "w.json")
    back = read_head_weights(path)
    torch.testing.assert_close(back.weights, weights.weights, atol=1e-6, rtol=0)
    assert (back.feature, back.model_fingerprint) == ("value", engine.model_info.fingerprint())
    assert engine.head_weights(path).feature == "value"
    other = engine_for("qwen2")
    with pytest.raises(ConfigError) as refused:
        other.head_weights(path)
    message = str(refused.value)
    assert engine.model_info.fingerprint() in message and other.model_info.fingerprint() in message
    assert "'tiny-llama'" in message and "'tiny-qwen2'" in message
    document = json.loads(path.read_text())
    cases = {
        "not json": ("{", "cannot read importance weights"),
        "format": (json.dumps({**document, "format": "x"}), "not a head-weights file (format 'x'"),
        "version": (json.dumps({**document, "format_version": 9}), "format version 9"),
        "missing": (json.dumps({k: v for k, v in document.items() if k != "model_fingerprint"}),
                    "damaged (no 'model_fingerprint')"),
        "feature": (json.dumps({**document, "feature": "magic"}), "feature must be one of attention, value, output"),
        "ragged": (json.dumps({**document, "weights": [[1.0, 2.0], [1.0]]}), "damaged weights"),
        "negative": (json.dumps({**document, "weights": [[1.0, -0.5]]}), "finite and >= 0, got -0.5"),
        "nan": (path.read_text().replace(str(document["weights"][0][0]), "NaN", 1), "finite and >= 0, got nan"),
        "infinite": (json.dumps({**document, "weights": [[1.0, 1e999]]}), "finite and >= 0, got inf"),
        "all zero": (json.dumps({**document, "weights": [[0.0] * 4] * 4}), "every weight is 0"),
    }
    for name, (text, expected) in cases.items():
        bad = tmp_path / f"{name}.json"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(expected)):
            read_head_weights(bad)
    small = HeadWeights(torch.ones(2, engine.num_heads), "value", "tiny-llama", engine.model_info.fingerprint())
    with pytest.raises(ConfigError, match=r"are \[2, 4\] \(layers, heads\); model 'tiny-llama' has 4 layers of 4"):
        engine.generate(EncodedInput(prompt_ids(8)), build_policy("dense"), max_new_tokens=2, importance="learned",
                        importance_weights=small)


def test_learned_without_weights_names_the_model(engine_for):
    engine = engine_for("llama")
    with pytest.raises(ConfigError, match="no shipped weights for model 'tiny-llama'.*--importance-weights"):
        engine.generate(EncodedInput(prompt_ids(8)), build_policy("dense"), max_new_tokens=2, importance="learned")
