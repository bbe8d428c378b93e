"""The ``learned`` policy: exact features on constructed inputs, a predictor file that round-trips and is
refused for another model, damaged or missing, and a tiny-model trace -> predictor -> policy run whose
budget holds every step."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from tiny_models import build_model, build_tokenizer, kept_after_step, prompt_ids  # noqa: E402
from tiny_training import train_tiny_learned_policy  # noqa: E402

from sparseety.engine import EncodedInput, SparseEngine  # noqa: E402
from sparseety.errors import ConfigError  # noqa: E402
from sparseety.policies import Observation, build_policy  # noqa: E402
from sparseety.policies.base import ModelInfo  # noqa: E402
from sparseety.policies.parts.learned_features import feature_names, slot_features  # noqa: E402
from sparseety.policies.parts.learned_model import Predictor, read_predictor  # noqa: E402

EPS = 1e-3


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_torch_thread):
    """Every test here runs tiny models on one torch thread (``one_torch_thread``, tests/conftest.py)."""


def test_features_of_constructed_slots_are_exact():
    positions = torch.tensor([[[0, 1, 2, 3]]])
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]]]])  # norms 1, 2, 3, 4
    attention = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    share_max = torch.tensor([[[1.0, 0.8, 2.0, 1.6]]])
    token_ids = torch.tensor([[[0, 1, 2, -1]]])
    table = torch.tensor([0, 2, 3], dtype=torch.int8)  # special, digits, words
    x = slot_features(positions, keys, attention, share_max, token_ids, table, layer=1, num_layers=3)
    names = feature_names(3, 1)
    assert x.shape == (1, 1, 4, len(names)) == (1, 1, 4, 6 + 5 + 3 + 1)
    std = math.sqrt(1.25)
    expected = {
        "rel_position": [0.0, 0.25, 0.5, 0.75],
        "log_position": [math.log(1), math.log(2), math.log(3), math.log(4)],
        "log_recency": [math.log(4), math.log(3), math.log(2), math.log(1)],
        "key_norm_z": [-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std],
        "log_attention_now": [math.log(0.4 + EPS), math.log(0.8 + EPS), math.log(1.2 + EPS), math.log(1.6 + EPS)],
        "log_attention_max": [math.log(1.0 + EPS), math.log(0.8 + EPS), math.log(2.0 + EPS), math.log(1.6 + EPS)],
        "class=special": [1, 0, 0, 0], "class=punctuation": [0, 0, 0, 0], "class=digits": [0, 1, 0, 0],
        "class=words": [0, 0, 1, 0], "class=whitespace": [0, 0, 0, 0],
        "layer=0": [0] * 4, "layer=1": [1] * 4, "layer=2": [0] * 4, "kv_head=0": [1] * 4,
    }
    assert list(expected) == names
    for i, name in enumerate(names):
        np.testing.assert_allclose(x[0, 0, :, i].numpy(), expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_slots_out_of_position_order_and_unknown_ids():
    """Features follow each slot's own position (slots are reused out of order); no ids: no class."""
    positions = torch.tensor([[[5, 0, 9]], [[1, 2, 3]]]).reshape(1, 2, 3)
    keys = torch.ones(1, 2, 3, 4)
    x = slot_features(positions, keys, torch.full((1, 2, 3), 1 / 3), torch.ones(1, 2, 3), None,
                      torch.zeros(0, dtype=torch.int8), layer=0, num_layers=1)
    np.testing.assert_allclose(x[0, 0, :, 0].numpy(), [0.5, 0.0, 0.9])
    np.testing.assert_allclose(x[0, 0, :, 2].numpy(), np.log1p([4, 9, 0]), rtol=1e-6)
    assert (x[..., 3] == 0).all()  # equal norms: z-score 0
    assert (x[..., 6:11] == 0).all()
    assert (x[0, 1, :, -1] == 1).all() and (x[0, 1, :, -2] == 0).all()


def predictor(features: list[str], model: str = "tiny-a", fingerprint: str = "sha256:aaaa", hidden: int = 3,
              seed: int = 0) -> Predictor:
    g = torch.Generator().manual_seed(seed)
    f = len(features)
    return Predictor(mean=torch.randn(f, generator=g), std=torch.rand(f, generator=g) + 0.5,
                     w1=torch.randn(f, hidden, generator=g), b1=torch.randn(hidden, generator=g),
                     w2=torch.randn(hidden if hidden else f, generator=g), b2=torch.randn(1, generator=g),
                     token_class=torch.tensor([0, 3, 2, 1], dtype=torch.int8), model=model,
                     model_fingerprint=fingerprint, features=features,
                     provenance={"seed": 7, "metrics": {"learned": {"recall@keep=0.5": 0.9}}})


def info(name: str = "tiny-a", fingerprint: str = "sha256:aaaa", layers: int = 2, heads: int = 2) -> ModelInfo:
    return ModelInfo(name=name, num_layers=layers, kv_heads=heads, head_dim=4, vocab_size=4,
                     fingerprint=lambda: fingerprint)


@pytest.mark.parametrize("hidden", [0, 3])
def test_predictor_file_round_trips(tmp_path, hidden):
    p = predictor(feature_names(2, 2), hidden=hidden)
    back = read_predictor(p.save(tmp_path / "p.safetensors"))
    for name, tensor in p.tensors().items():
        assert torch.equal(getattr(back, name), tensor), name
    assert back.metadata() == p.metadata()
    assert (back.model, back.model_fingerprint, back.features, back.provenance) == (
        p.model, p.model_fingerprint, p.features, p.provenance)
    x = torch.randn(5, len(p.features))
    torch.testing.assert_close(back(x), p(x), rtol=0, atol=1e-6)


def test_refuses_a_file_trained_for_another_model(tmp_path):
    path = predictor(feature_names(2, 2)).save(tmp_path / "p.safetensors")
    policy = build_policy("learned", 4, {"model": str(path)})
    policy.bind(info())  # the model it was trained for
    with pytest.raises(ConfigError) as err:
        policy.bind(info(name="tiny-b", fingerprint="sha256:bbbb"))
    assert "tiny-a" in str(err.value) and "tiny-b" in str(err.value)
    assert "sha256:aaaa" in str(err.value) and "sha256:bbbb" in str(err.value)


def test_refuses_a_wrong_feature_set(tmp_path):
    path = predictor(feature_names(2, 2)[:-1]).save(tmp_path / "p.safetensors")
    with pytest.raises(ConfigError, match="feature set"):
        build_policy("learned", 4, {"model": str(path)}).bind(info())
    path = predictor(feature_names(3, 2)).save(tmp_path / "q.safetensors")  # trained on 3 layers
    with pytest.raises(ConfigError, match="feature set"):
        build_policy("learned", 4, {"model": str(path)}).bind(info())


def test_refuses_missing_damaged_and_foreign_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_policy("learned", 4, {"model": str(tmp_path / "nope.safetensors")})
    good = predictor(feature_names(2, 2)).save(tmp_path / "p.safetensors").read_bytes()
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(good[: len(good) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a safetensors file at all" * 10)
    for path in (torn, garbage):
        with pytest.raises(ConfigError, match="not a readable predictor file"):
            build_policy("learned", 4, {"model": str(path)})
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(3)}, str(foreign))
    with pytest.raises(ConfigError, match="not a learned-policy file"):
        build_policy("learned", 4, {"model": str(foreign)})
    with pytest.raises(ConfigError, match="no predictor file"):
        build_policy("learned", 4).bind(info())


def test_layer_mode_shares_one_score_per_position(tmp_path):
    path = predictor(feature_names(2, 2)).save(tmp_path / "p.safetensors")
    obs = Observation(layer=1, num_layers=2, step=0, prefill=True, positions=torch.arange(5).expand(1, 2, 5),
                      keys=torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(1)),
                      attention=torch.softmax(torch.randn(1, 2, 5, generator=torch.Generator().manual_seed(2)), -1),
                      state=None, seed=0, token_ids=torch.tensor([0, 1, 2, 3, 9]).expand(1, 2, 5))
    shared, state = build_policy("learned", 3, {"model": str(path)}).score(obs)
    own, _ = build_policy("learned", 3, {"model": str(path), "heads": "kv_head"}).score(obs)
    assert shared.shape == own.shape == (1, 2, 5)
    assert torch.equal(shared[0, 0], shared[0, 1])
    torch.testing.assert_close(shared[0, 0], own[0].mean(dim=0))
    torch.testing.assert_close(state, obs.attention * 5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tier-3 dense traces of tiny llama (long-document protocol), a predictor trained on them, and the engine."""
    return train_tiny_learned_policy(tmp_path_factory.mktemp("learned"))


def test_trace_to_predictor_to_policy_holds_the_budget(trained):
    engine, result, path = trained
    assert len(result.train_requests) == 3 and len(result.heldout_requests) == 1
    assert set(result.metrics) == {"learned", "learned_kv_head", "tova", "h2o", "recency"}
    provenance = read_predictor(path).provenance
    assert provenance["model"] == "tiny-llama" and provenance["requests"] == 4
    assert provenance["model_fingerprint"] == engine.model_info.fingerprint()
    assert provenance["text_source"] == "random token ids" and provenance["config"]["seed"] == 0
    assert provenance["metrics"] == result.metrics and "sparseety_version" in provenance
    budget, prompt, new = 12, 30, 8
    for heads in ("layer", "kv_head"):
        run = engine.generate(EncodedInput(prompt_ids(prompt, seed=9)), build_policy(
            "learned", budget, {"model": str(path), "heads": heads}), max_new_tokens=new, tier=2)
        assert run.eviction_events > 0
        for step in range(new):
            seen = prompt + step
            for layer in range(engine.num_layers):
                for head in range(engine.kv_heads):
                    assert len(kept_after_step(run, layer, head, step, seen)) == min(budget, seen)
        if heads == "layer":
            for by_head in run.kept_positions_final.values():
                assert by_head["0"] == by_head["1"]


def test_a_run_on_another_model_is_refused_naming_both(trained):
    _, _, path = trained
    other = SparseEngine(build_model("qwen2"), build_tokenizer(), model_name="tiny-qwen2")
    with pytest.raises(ConfigError) as err:
        other.generate(EncodedInput(prompt_ids(20)), build_policy("learned", 8, {"model": str(path)}),
                       max_new_tokens=2)
    assert "tiny-llama" in str(err.value) and "tiny-qwen2" in str(err.value)


@pytest.mark.parametrize("chunk", [7, 64])
def test_batched_and_chunked_prefill_keep_the_same_sets_as_alone(trained, chunk):
    """Token ids reach the policy per chunk as they do in one prefill; a batch neighbour changes nothing."""
    from sparseety.engine.request import GenerationOptions

    engine, _, path = trained
    policy = build_policy("learned", 14, {"model": str(path)})
    inputs = [EncodedInput(prompt_ids(40, seed=11)), EncodedInput(prompt_ids(33, seed=12))]
    alone = [engine.generate(e, policy, max_new_tokens=6, tier=2) for e in inputs]
    batched = engine.generate_batch(inputs, policy, GenerationOptions(max_new_tokens=6, tier=2), prefill_chunk=chunk)
    for a, b in zip(alone, batched):
        assert b.output_ids == a.output_ids
        assert b.kept_positions_final == a.kept_positions_final
        np.testing.assert_array_equal(b.arrays["evicted.position"], a.arrays["evicted.position"])
