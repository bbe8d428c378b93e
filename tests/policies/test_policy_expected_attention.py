"""``expected_attention``: kvpress's scoring against an explicit-matrix reimplementation, known kept sets,
the engine's query rows and RoPE frequencies, budgets, chunking and options."""

from __future__ import annotations

import dataclasses
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kv_policy_checks import assert_budget_holds, assert_chunked_equals_one_prefill, engine
from tiny_models import prompt_ids
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from sparseety.engine import EncodedInput
from sparseety.errors import ConfigError
from sparseety.policies import build_policy, get_policy_class, list_policies
from sparseety.policies.base import Observation, select_keep
from sparseety.policies.expected_attention import ExpectedAttentionPolicy
from sparseety.policies.parts.rotary import inverse_frequencies, rotate, unrotate


def rope_matrix(position: float, inv_freq: np.ndarray, d: int) -> np.ndarray:
    """The explicit ``[d, d]`` RoPE rotation (``rotate_half`` layout) at ``position``."""
    half = len(inv_freq)
    M = np.eye(d)
    for i, f in enumerate(inv_freq):
        c, s = math.cos(position * f), math.sin(position * f)
        M[i, i], M[i, i + half], M[i + half, i], M[i + half, i + half] = c, -s, s, c
    return M


def reference(keys, values, queries, inv_freq, n_future=512, n_sink=4, covariance=True, vnorm=True, eps=0.0,
              first_row=0):
    """A plain float64 loop over heads: un-rotate each query row (from ``first_row``), mean/cov, average rotation ahead, scores."""
    b, kvh, n, d = keys.shape
    h = queries.shape[1]
    g = h // kvh
    future = n  # the prefill's next position
    Rbar = np.mean([rope_matrix(t, inv_freq, d) for t in range(future, future + n_future)], axis=0)
    out = np.zeros((b, kvh, n))
    for i in range(b):
        for kv in range(kvh):
            per_head = []
            for hq in range(kv * g, (kv + 1) * g):
                pre = np.stack([rope_matrix(p, inv_freq, d).T @ queries[i, hq, p] for p in range(max(n_sink, first_row), n)])
                mu = pre.mean(axis=0)
                cov = (pre - mu).T @ (pre - mu) / len(pre)
                mu, cov = Rbar @ mu, Rbar @ cov @ Rbar.T
                logits = np.array([mu @ k / math.sqrt(d) + (k @ cov @ k / d / 2 if covariance else 0.0)
                                   for k in keys[i, kv, n_sink:]])
                p = np.exp(logits - logits.max())
                per_head.append(p / p.sum())
            p = np.mean(per_head, axis=0)
            if vnorm:
                p = (p + eps) * np.linalg.norm(values[i, kv, n_sink:], axis=-1)
            out[i, kv, :n_sink] = np.inf
            out[i, kv, n_sink:] = p
    return out


def observation(keys, values, queries, rotary, *, prefill=True, state=None, positions=None):
    b, kvh, n, _ = keys.shape
    positions = torch.arange(n).expand(b, kvh, n) if positions is None else positions
    return Observation(layer=0, num_layers=1, step=0 if prefill else 1, prefill=prefill, positions=positions,
                       keys=keys, attention=None, state=state, seed=0, queries=queries, values=values, rotary=rotary)


def roped(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply RoPE at positions 0..r-1 to ``[..., r, d]``."""
    positions = torch.arange(x.shape[-2]).float()
    return rotate(x, positions.unsqueeze(-1) * inv_freq)


@pytest.mark.parametrize("covariance, vnorm, eps", [(True, True, 0.0), (False, True, 0.01), (True, False, 0.0)])
def test_scores_equal_an_explicit_matrix_reimplementation(covariance, vnorm, eps):
    gen = torch.Generator().manual_seed(1)
    b, kvh, h, n, d = 1, 2, 4, 40, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    keys = roped(torch.randn(b, kvh, n, d, generator=gen), inv_freq)
    values = torch.randn(b, kvh, n, d, generator=gen)
    queries = roped(torch.randn(b, h, n, d, generator=gen) + 2 * torch.randn(1, h, 1, d, generator=gen), inv_freq)
    policy = build_policy("expected_attention", 12, {"n_future_positions": "64", "use_covariance": str(covariance),
                                                     "use_vnorm": str(vnorm), "epsilon": str(eps)})
    scores, state = policy.score(observation(keys, values, queries, inv_freq))
    expected = reference(keys.double().numpy(), values.double().numpy(), queries.double().numpy(),
                         inv_freq.double().numpy(), 64, 4, covariance, vnorm, eps)
    assert torch.isinf(scores[..., :4]).all() and torch.equal(state, scores)
    np.testing.assert_allclose(scores[..., 4:].numpy(), expected[..., 4:], rtol=2e-4, atol=1e-7)
    kept = select_keep(scores, 12)
    expected_kept = np.sort(np.argsort(-expected, axis=-1, kind="stable")[..., :12], axis=-1)
    np.testing.assert_array_equal(kept.numpy(), expected_kept)


def test_known_kept_set_without_rope():
    """Identical queries u, keys c * u, equal value norms: sinks plus the largest c are kept."""
    d, n = 4, 10
    u = torch.tensor([1.0, 0.5, -0.5, 0.25])
    c = torch.tensor([0.0, 0.0, 0.3, 2.0, -1.0, 1.5, 0.1, 3.0, 0.2, -2.0])
    keys = (c.view(1, 1, n, 1) * u).expand(1, 2, n, d).clone()
    values = torch.ones(1, 2, n, d)
    queries = u.expand(1, 4, n, d).clone()
    scores, _ = build_policy("expected_attention", 5, {"n_sink": "2"}).score(observation(keys, values, queries, None))
    assert select_keep(scores, 5)[0].tolist() == [[0, 1, 3, 5, 7]] * 2


def test_decode_scores_only_the_new_slot_and_keeps_the_others():
    gen = torch.Generator().manual_seed(2)
    n, d = 20, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    keys, values = torch.randn(1, 2, n, d, generator=gen), torch.randn(1, 2, n, d, generator=gen)
    state = torch.rand(1, 2, n, generator=gen)
    state[..., -1] = 0  # a new slot holds 0
    positions = torch.arange(100, 100 + n).expand(1, 2, n).clone()
    positions[..., 0] = 0  # a sink survived
    query = torch.randn(1, 4, 1, d, generator=gen)
    policy = build_policy("expected_attention", 19)
    scores, new_state = policy.score(observation(keys, values, query, inv_freq, prefill=False, state=state,
                                                 positions=positions))
    assert torch.equal(scores[..., 1:-1], state[..., 1:-1]) and torch.isinf(scores[..., 0]).all()
    # the new slot: the same rule with the step's own query (one row, no covariance), normalised over the held slots
    pre = unrotate(query, positions[:, 0, -1:].unsqueeze(1), inv_freq)[0, :, 0].double().numpy()
    Rbar = np.mean([rope_matrix(t, inv_freq.double().numpy(), d) for t in range(120, 120 + 512)], axis=0)
    for kv in range(2):
        probs = []
        for hq in (2 * kv, 2 * kv + 1):
            logits = keys[0, kv, 1:].double().numpy() @ (Rbar @ pre[hq]) / math.sqrt(d)
            p = np.exp(logits - logits.max())
            probs.append(p[-1] / p.sum())
        expected = np.mean(probs) * float(values[0, kv, -1].norm())
        assert scores[0, kv, -1].item() == pytest.approx(expected, rel=1e-4)
    assert torch.equal(new_state, scores)


def test_query_window_uses_only_the_last_rows():
    gen = torch.Generator().manual_seed(4)
    n, d = 30, 8
    keys, values = torch.randn(1, 2, n, d, generator=gen), torch.randn(1, 2, n, d, generator=gen)
    queries = torch.randn(1, 4, n, d, generator=gen)
    windowed = build_policy("expected_attention", 10, {"query_window": "6"})
    assert windowed.query_rows() == 6 and ExpectedAttentionPolicy(budget=10).query_rows() >= 1 << 30
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    got, _ = windowed.score(observation(keys, values, queries[:, :, -6:], inv_freq))
    expected = reference(keys.double().numpy(), values.double().numpy(), queries.double().numpy(),
                         inv_freq.double().numpy(), first_row=n - 6)
    np.testing.assert_allclose(got[..., 4:].numpy(), expected[..., 4:], rtol=2e-4, atol=1e-7)


def test_rope_frequencies_follow_the_layer_type():
    """Gemma 3: sliding layers use one theta, full layers another; read per ``layer_types``."""
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_hidden_layers=6, vocab_size=160)
    rope = Gemma3RotaryEmbedding(config)
    for layer, kind in enumerate(config.layer_types):
        got = inverse_frequencies(SimpleNamespace(config=config, layer_idx=layer))
        torch.testing.assert_close(got, getattr(rope, f"{kind}_inv_freq").float())
    assert not torch.equal(inverse_frequencies(SimpleNamespace(config=config, layer_idx=0)),
                           inverse_frequencies(SimpleNamespace(config=config, layer_idx=5)))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_engine_hands_post_rope_query_rows_and_the_models_frequencies(family):
    """Un-rotating what the engine hands over gives the layer's pre-RoPE projections of the same hidden states."""
    eng = engine(family)
    attn = eng.model.model.layers[1].self_attn
    torch.testing.assert_close(inverse_frequencies(attn), eng.model.model.rotary_emb.inv_freq.float())
    hidden, seen = [], []

    class Spy(ExpectedAttentionPolicy):
        def score(self, obs):
            if obs.layer == 1:  # the cache compacts its buffers in place after scoring: copy what is checked
                seen.append(dataclasses.replace(obs, keys=obs.keys.clone(), values=obs.values.clone(),
                                                positions=obs.positions.clone()))
            return super().score(obs)

    handle = attn.register_forward_pre_hook(lambda m, a, kw: hidden.append(kw["hidden_states"]), with_kwargs=True)
    try:
        eng.generate(EncodedInput(prompt_ids(24)), Spy(budget=16), max_new_tokens=3, tier=0)
    finally:
        handle.remove()
    prefill, decode = seen[0], seen[1]
    assert prefill.prefill and prefill.queries.shape[2] == 24 and decode.queries.shape[2] == 1
    assert prefill.values.shape == prefill.keys.shape
    d = prefill.keys.shape[-1]
    h = hidden[0]
    with torch.inference_mode():
        q_pre = attn.q_proj(h).view(1, 24, -1, d).transpose(1, 2)
        k_pre = attn.k_proj(h).view(1, 24, -1, d).transpose(1, 2)
    positions = torch.arange(24).view(1, 1, 24)
    assert torch.equal(prefill.positions, positions.expand(1, 2, 24))
    torch.testing.assert_close(unrotate(prefill.queries, positions, prefill.rotary), q_pre, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(unrotate(prefill.keys, positions, prefill.rotary), k_pre, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("options", "field"), [
    ({"n_future_positions": "0"}, "n_future_positions"), ({"n_sink": "-1"}, "n_sink"),
    ({"epsilon": "-0.1"}, "epsilon"), ({"epsilon": "nan"}, "epsilon"), ({"query_window": "-3"}, "query_window"),
    ({"use_vnorm": "maybe"}, "use_vnorm"), ({"n_sinks": "4"}, "n_sinks"),
])
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        build_policy("expected_attention", 8, options)


def test_registry_lists_it_with_its_paper():
    cls = get_policy_class("expected_attention")
    assert cls in list_policies() and cls.evicts and cls.summary
    assert "2510.00636" in sys.modules[cls.__module__].__doc__


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_budget_holds_per_layer_and_head_at_every_step(family):
    assert_budget_holds(build_policy("expected_attention", 16), family)


@pytest.mark.parametrize("options", [{}, {"query_window": "16"}])
@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_prefill_keeps_the_same_sets(chunk, options):
    assert_chunked_equals_one_prefill(build_policy("expected_attention", 30, options), chunk)
