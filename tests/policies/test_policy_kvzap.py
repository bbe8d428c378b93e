"""The ``kvzap`` policy: its surrogate's scores against an independent computation on a tiny model (prefill
and decode tokens), the threshold mode's kept sets, the surrogate file's round trip and refusals,
and the shipped files on the default model (its training: ``tests/training/test_training_kvzap_surrogate.py``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))

from tiny_models import build_model, build_tokenizer, prompt_ids  # noqa: E402

from sparseety.cli import app  # noqa: E402
from sparseety.engine import EncodedInput, SparseEngine  # noqa: E402
from sparseety.errors import ConfigError  # noqa: E402
from sparseety.fingerprint import model_fingerprint  # noqa: E402
from sparseety.policies import build_policy  # noqa: E402
from sparseety.policies.base import ModelInfo  # noqa: E402
from sparseety.policies.parts.kvzap_model import Surrogate, read_surrogate  # noqa: E402
from sparseety.policies.parts.learned_model import WEIGHTS_DIR  # noqa: E402

LAYERS, HIDDEN, KV = 4, 64, 2


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_torch_thread):
    """Every test here runs tiny models on one torch thread (``one_torch_thread``, tests/conftest.py)."""


@pytest.fixture(scope="module")
def tiny():
    """A wrapped tiny llama and an identical never-wrapped reference build."""
    return SparseEngine(build_model("llama"), build_tokenizer(), model_name="tiny-llama"), build_model("llama")


def surrogate(fingerprint: str, hidden: int = 0, model: str = "tiny-llama", layers: int = LAYERS,
              seed: int = 0) -> Surrogate:
    g = torch.Generator().manual_seed(seed)
    width = hidden or HIDDEN
    return Surrogate(w1=torch.randn(layers, HIDDEN, hidden, generator=g) / 8, b1=torch.randn(layers, hidden, generator=g),
                     w2=torch.randn(layers, width, KV, generator=g) / 8, b2=torch.randn(layers, KV, generator=g),
                     model=model, model_fingerprint=fingerprint, provenance={"seed": seed})


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory):
    """Linear and MLP surrogate files trained (randomly) for the tiny llama."""
    root = tmp_path_factory.mktemp("kvzap")
    fp = model_fingerprint(tiny[0].model)
    return {"linear": surrogate(fp).save(root / "linear.safetensors"),
            "mlp": surrogate(fp, hidden=5, seed=1).save(root / "mlp.safetensors")}


def independent_scores(reference: torch.nn.Module, ids: list[int], s: Surrogate) -> list[np.ndarray]:
    """Per layer ``[n, K]`` float64: the surrogate applied to the attention input (input_layernorm of the
    residual stream) of a plain forward over ``ids``; GELU written out from erf."""
    with torch.no_grad():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
        scores = []
        for layer in range(LAYERS):
            x = reference.model.layers[layer].input_layernorm(out.hidden_states[layer])[0].double()
            if s.w1.shape[-1]:
                z = x @ s.w1[layer].double() + s.b1[layer].double()
                x = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
            scores.append((x @ s.w2[layer].double() + s.b2[layer].double()).numpy())
    return scores


def shared_counts(scores: list[np.ndarray], sinks: int, budget: int, floor: float = 0.0) -> list[int]:
    """Per layer the slots per head it keeps when the layers share ``budget x layers`` (``share=true``),
    written independently: a layer's rank-j gain is the best j-th score of its heads (sinks first); the
    first ``ceil(floor x budget)`` ranks (at least one) are every layer's own."""
    gains, owner = [], []
    for layer, s in enumerate(scores):
        s = s.copy()
        s[:sinks] = np.inf
        gain = (-np.sort(-s, axis=0)).max(axis=1)  # per rank, the best head's score at that rank
        gain[: max(1, math.ceil(floor * budget))] = np.inf
        gains.append(gain)
        owner.append(np.full(gain.shape[0], layer))
    order = np.argsort(-np.concatenate(gains), kind="stable")[: budget * len(scores)]
    return np.bincount(np.concatenate(owner)[order], minlength=len(scores)).tolist()


def head_counts_np(scores: list[np.ndarray], sinks: int, budget: int, layers: list[int]) -> dict[int, list[int]]:
    """Per layer of ``layers`` the slots each KV head keeps when their (layer, head, slot) scores share
    ``budget x heads x len(layers)`` (``per_head=true``), written independently: every head's best slot
    (a sink here) first, then the highest scores (ties: the lower layer, head, slot)."""
    flat, owner = [], []
    for i, layer in enumerate(layers):
        s = scores[layer].copy()
        s[:sinks] = np.inf
        for head in range(s.shape[1]):
            col = s[:, head].copy()
            col[np.argmax(col)] = np.inf
            flat.append(col)
            owner.append(np.full(col.shape[0], i * s.shape[1] + head))
    order = np.argsort(-np.concatenate(flat), kind="stable")[: budget * KV * len(layers)]
    won = np.bincount(np.concatenate(owner)[order], minlength=KV * len(layers))
    return {layer: won[i * KV : (i + 1) * KV].tolist() for i, layer in enumerate(layers)}


@pytest.mark.parametrize("kind,share,floor,per_head", [("linear", True, 0.0, False), ("mlp", True, 0.0, False),
                                                       ("linear", False, 0.0, False), ("linear", True, 0.8, False),
                                                       ("linear", False, 0.0, True), ("linear", True, 0.0, True)])
def test_scores_equal_an_independent_computation_in_prefill_and_decode(tiny, files, kind, share, floor, per_head):
    engine, reference = tiny
    ids = prompt_ids(60, seed=3)
    policy = build_policy("kvzap", 30, {"model": str(files[kind]), "surrogate": kind, "window": "4",
                                        "share": str(share).lower(), "floor": str(floor),
                                        "per_head": str(per_head).lower()})
    result = engine.generate(EncodedInput(ids), policy, max_new_tokens=12, tier=1)
    expected = independent_scores(reference, result.token_ids, read_surrogate(files[kind]))
    a = result.arrays
    # a prompt token's hidden states come from the dense prefill; a decoded token's, past layer 0 (the
    # embeddings), from attention over the compressed cache, which the dense reference does not see
    comparable = (a["evicted.position"] < 60) | (a["evicted.layer"] == 0)
    got = np.array([expected[layer][pos, head] for layer, head, pos in
                    zip(a["evicted.layer"][comparable], a["evicted.kv_head"][comparable],
                        a["evicted.position"][comparable])])
    np.testing.assert_allclose(a["evicted.score"][comparable].astype(np.float64), got, rtol=1e-4, atol=1e-4)
    decoded = comparable & (a["evicted.position"] >= 60)
    assert decoded.any(), "a token written while decoding was scored and evicted"
    prefill = a["evicted.step"] == 0
    if per_head:
        groups = [list(range(LAYERS))] if share else [[layer] for layer in range(LAYERS)]
        per = {k: v for g in groups for k, v in head_counts_np([e[:60] for e in expected], 4, 30, g).items()}
        counts = [per[layer] for layer in range(LAYERS)]
        assert sum(map(sum, counts)) == 30 * KV * LAYERS and len({c for cs in counts for c in cs}) > 1, counts
    else:
        uniform = shared_counts([e[:60] for e in expected], 4, 30, floor) if share else [30] * LAYERS
        assert sum(uniform) == 30 * LAYERS and (len(set(uniform)) > 1) == share and min(uniform) >= floor * 30, uniform
        counts = [[c] * KV for c in uniform]
    for layer in range(LAYERS):  # the prefill evicts each head's lowest of the non-sink positions down to its count
        for head in range(KV):
            sel = prefill & (a["evicted.layer"] == layer) & (a["evicted.kv_head"] == head)
            # lowest first; equal scores (a repeated token at layer 0): the later position goes first
            order = 4 + np.lexsort((-np.arange(4, 60), expected[layer][4:60, head]))
            assert sorted(a["evicted.position"][sel].tolist()) == sorted(order[: 60 - counts[layer][head]].tolist())


def expected_threshold_kept(scores: np.ndarray, threshold: float, sinks: int, window: int,
                            cap: int | None) -> tuple[list[set[int]], int]:
    """Per head the kept positions of one prefill in threshold mode, and the count each head keeps."""
    n = scores.shape[0]
    protected = (np.arange(n) < sinks) | (np.arange(n) > n - 1 - window)
    s = np.where(protected[:, None], np.inf, scores)
    count = max(1, int((s >= threshold).sum(axis=0).max()))
    count = min(count, cap) if cap else count
    kept = [set(np.lexsort((np.arange(n), -s[:, h]))[:count].tolist()) for h in range(s.shape[1])]
    return kept, count


@pytest.mark.parametrize("cap", [0, 10])
def test_threshold_mode_keeps_what_scores_above_it(tiny, files, cap):
    engine, reference = tiny
    ids = prompt_ids(70, seed=5)
    s = read_surrogate(files["linear"])
    expected = independent_scores(reference, ids[0].tolist(), s)
    values = np.unique(np.concatenate([e.reshape(-1) for e in expected]))
    threshold = float(values[len(values) // 2 - 1: len(values) // 2 + 1].mean())  # halfway between two scores
    options = {"model": str(files["linear"]), "threshold": str(threshold), "window": "6", "max_kept": str(cap)}
    result = engine.generate(EncodedInput(ids), build_policy("kvzap", None, options), max_new_tokens=1, tier=2)
    fractions = []
    for layer in range(LAYERS):
        kept, count = expected_threshold_kept(expected[layer], threshold, 4, 6, cap)
        for head in range(KV):
            assert set(result.kept_positions_final[str(layer)][str(head)]) == kept[head], (layer, head)
        fractions.append(count / 70)
    np.testing.assert_allclose(result.arrays["kept_fraction"], fractions, rtol=1e-6)
    assert any(f < 1 for f in fractions)
    if cap:
        assert all(len(heads) == cap for layer in result.kept_positions_final.values() for heads in layer.values())


def test_threshold_admission_reserves_the_cap_or_the_dense_size(tiny, files):
    engine, _ = tiny
    e = EncodedInput(prompt_ids(50, seed=1))
    opts = {"model": str(files["linear"]), "threshold": "-1"}
    dense = engine.reserved_kv_bytes(e, build_policy("dense"), 8)
    assert engine.reserved_kv_bytes(e, build_policy("kvzap", None, opts), 8) == dense
    capped = engine.reserved_kv_bytes(e, build_policy("kvzap", None, {**opts, "max_kept": "12"}), 8)
    assert capped == engine.reserved_kv_bytes(e, build_policy("streaming", 12), 8) < dense


def test_option_errors_name_the_field_and_value(files):
    path = str(files["linear"])
    with pytest.raises(ConfigError, match="either threshold= or a budget"):
        build_policy("kvzap", 16, {"model": path, "threshold": "-4"})
    with pytest.raises(ConfigError, match=r"threshold must be a number .* got 'low'"):
        build_policy("kvzap", None, {"model": path, "threshold": "low"})
    with pytest.raises(ConfigError, match="needs --budget N or --ratio R"):
        build_policy("kvzap", None, {"model": path})
    with pytest.raises(ConfigError, match=r"kvzap.*share.*'maybe'"):
        build_policy("kvzap", 16, {"model": path, "share": "maybe"})
    with pytest.raises(ConfigError, match=r"kvzap: option per_head='often' is not a valid bool"):
        build_policy("kvzap", 16, {"model": path, "per_head": "often"})
    for bad in ("1.5", "half"):
        with pytest.raises(ConfigError, match=rf"kvzap.*floor.*\b'?{bad}'?"):
            build_policy("kvzap", 16, {"model": path, "share": "true", "floor": bad})
    with pytest.raises(ConfigError, match="max_kept caps a threshold run"):
        build_policy("kvzap", 16, {"model": path, "max_kept": "8"})
    with pytest.raises(ConfigError, match="surrogate must be one of linear, mlp, got 'tree'"):
        build_policy("kvzap", 16, {"surrogate": "tree"})
    with pytest.raises(ConfigError, match="holds a linear surrogate, but surrogate=mlp"):
        build_policy("kvzap", 16, {"model": path, "surrogate": "mlp"})


@pytest.mark.parametrize("value", ["inf", "-inf", "Infinity", "nan"])
def test_an_infinite_threshold_is_refused_like_nan(files, value):
    with pytest.raises(ConfigError, match=rf"kvzap: threshold must be a finite number .* got {float(value)!r}"):
        build_policy("kvzap", None, {"model": str(files["linear"]), "threshold": value})


@pytest.mark.parametrize("policy,key", [("h2o", "recent_ratio"), ("expected_attention", "epsilon"),
                                        ("kvzap", "floor")])
@pytest.mark.parametrize("value", ["inf", "-inf", float("inf")])
def test_every_float_option_refuses_infinity(policy, key, value):
    with pytest.raises(ConfigError, match=rf"{policy}: option {key} must be a finite number, got -?inf"):
        build_policy(policy, 16, {key: value})


@pytest.mark.parametrize("budget,options,words", [
    (16, {"floor": "0.5"}, ["floor=0.5 does nothing under per_head=true (the default)"]),
    (16, {"floor": "0.5", "share": "true"}, ["floor=0.5 does nothing under per_head=true"]),
    (16, {"floor": "0.5", "per_head": "false"}, ["floor=0.5 does nothing under share=false"]),
    (None, {"threshold": "-4", "share": "true"}, ["share=true does nothing in threshold mode (threshold=-4)"]),
    (None, {"threshold": "-4", "floor": "0.2"}, ["floor=0.2 does nothing in threshold mode"]),
])
def test_options_without_effect_in_the_mode_are_refused_naming_it(files, budget, options, words):
    with pytest.raises(ConfigError) as err:
        build_policy("kvzap", budget, {"model": str(files["linear"]), **options})
    assert all(w in str(err.value) for w in words), str(err.value)
    # where they act, they are taken
    build_policy("kvzap", 16, {"model": str(files["linear"]), "share": "true", "per_head": "false", "floor": "0.5"})


def info(name: str = "tiny-a", fingerprint: str = "sha256:aaaa", layers: int = LAYERS) -> ModelInfo:
    return ModelInfo(name=name, num_layers=layers, kv_heads=KV, head_dim=16, vocab_size=160,
                     fingerprint=lambda: fingerprint)


@pytest.mark.parametrize("hidden", [0, 3])
def test_surrogate_file_round_trips(tmp_path, hidden):
    s = surrogate("sha256:aaaa", hidden=hidden, model="tiny-a")
    back = read_surrogate(s.save(tmp_path / "s.safetensors"))
    for name, tensor in s.tensors().items():
        assert torch.equal(getattr(back, name), tensor), name
    assert back.metadata() == s.metadata() and back.kind == ("mlp" if hidden else "linear")
    x = torch.randn(1, 7, HIDDEN)
    torch.testing.assert_close(back(2, x), s(2, x), rtol=0, atol=0)
    assert back(2, x).shape == (1, KV, 7)


def test_refuses_other_models_and_damaged_missing_or_foreign_files(tmp_path):
    path = surrogate("sha256:aaaa", model="tiny-a").save(tmp_path / "s.safetensors")
    policy = build_policy("kvzap", 8, {"model": str(path)})
    policy.bind(info())
    with pytest.raises(ConfigError) as err:
        policy.bind(info(name="tiny-b", fingerprint="sha256:bbbb"))
    assert all(word in str(err.value) for word in ("kvzap:", "tiny-a", "tiny-b", "sha256:aaaa", "sha256:bbbb"))
    with pytest.raises(ConfigError, match="has 4 layers x 2 KV heads, the model 3 x 2"):
        policy.bind(info(layers=3))
    with pytest.raises(ConfigError, match="does not exist"):
        build_policy("kvzap", 8, {"model": str(tmp_path / "nope.safetensors")})
    good = path.read_bytes()
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match="kvzap: .* not a readable predictor file"):
        build_policy("kvzap", 8, {"model": str(torn)})
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"w1": torch.zeros(3)}, str(foreign), metadata={"format": "sparseety-learned-policy"})
    with pytest.raises(ConfigError, match="not a kvzap-policy file"):
        build_policy("kvzap", 8, {"model": str(foreign)})
    bent = tmp_path / "bent.safetensors"
    t = surrogate("sha256:aaaa").tensors()
    save_file({**t, "b2": torch.zeros(LAYERS, KV + 1)}, str(bent), metadata=surrogate("sha256:aaaa").metadata())
    with pytest.raises(ConfigError, match="are not \\[L, D, H\\]"):
        build_policy("kvzap", 8, {"model": str(bent)})
    with pytest.raises(ConfigError, match="no surrogate file given, and no linear surrogate ships for model 'tiny-a'"):
        build_policy("kvzap", 8).bind(info())


@pytest.mark.model
def test_run_policy_kvzap_with_no_path_uses_the_shipped_surrogate(tmp_path):
    assert (WEIGHTS_DIR / "kvzap-linear-smollm2-135m.safetensors").is_file()
    text = " ".join(f"Sentence {i} of the document says nothing of note." for i in range(20))
    done = CliRunner().invoke(app, ["run", "--prompt", text, "--policy", "kvzap", "--ratio", "0.5", "--max-new-tokens",
                                    "4", "--trace-dir", str(tmp_path / "t"), "--no-report", "--json"])
    assert done.exit_code == 0, done.output
    sparsity = json.JSONDecoder().raw_decode(done.output)[0]["sparsity"]
    assert sparsity["params"]["trained_for"] == "smollm2-135m" and sparsity["evicted_positions"] > 0
    assert sparsity["params"]["surrogate_file"] == "the shipped kvzap-linear-smollm2-135m.safetensors"


@pytest.mark.model
@pytest.mark.parametrize("policy", ["kvzap", "learned"])
def test_shipped_files_find_a_pass_key_on_the_default_model(smollm_engine, policy):
    from sparseety.engine import encode_document

    text = " ".join(f"Sentence {i} of the document says nothing of note." for i in range(30))
    encoded = encode_document(smollm_engine.tokenizer, text + " The pass key is 4821. Remember it.",
                              "What is the pass key?", None)
    result = smollm_engine.generate(encoded, build_policy(policy, encoded.compress_len // 2), max_new_tokens=14, tier=1)
    assert result.params["trained_for"] == "smollm2-135m" and result.evicted_positions > 0
    assert "4821" in result.text
