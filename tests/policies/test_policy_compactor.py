"""``compactor``: kvpress's CompactorPress scoring against a plain float64 loop, a known leverage outlier,
the seeded sketch, the decode rule, budgets, chunking and options."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from kv_policy_checks import assert_budget_holds, assert_chunked_equals_one_prefill

from sparseety.errors import ConfigError
from sparseety.policies import build_policy, get_policy_class, list_policies
from sparseety.policies.base import Observation, select_keep
from sparseety.policies.compactor import sketch
from sparseety.policies.parts.rotary import rotate


def rope_matrix(position: float, inv_freq: np.ndarray, d: int) -> np.ndarray:
    half = len(inv_freq)
    M = np.eye(d)
    for i, f in enumerate(inv_freq):
        c, s = math.cos(position * f), math.sin(position * f)
        M[i, i], M[i, i + half], M[i + half, i], M[i + half, i + half] = c, -s, s, c
    return M


def znorm(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / max(x.std(ddof=1), 1e-6)


def reference(keys, values, queries, inv_freq, phi, chunk, blending, start=8, end=4):
    """Plain loops (batch 1): leverage with an explicit inverse, tiles padded as kvpress pads them, pooling by 3."""
    _, kvh, n, d = keys.shape
    g = queries.shape[1] // kvh
    lo, hi = start, n - end
    s = hi - lo
    lev = np.zeros((kvh, s))
    attn = np.zeros((kvh, s))
    for kv in range(kvh):
        pre = np.stack([keys[0, kv, p] if inv_freq is None else rope_matrix(p, inv_freq, d).T @ keys[0, kv, p]
                        for p in range(lo, hi)])
        X = (pre - pre.mean(axis=0)) @ phi[0, kv]
        inv = np.linalg.inv(X.T @ X + 1e-2 * np.eye(X.shape[1]))
        lev[kv] = np.clip([x @ inv @ x for x in X], 0, None)
        per_head = np.zeros((g, s))
        for j, hq in enumerate(range(kv * g, (kv + 1) * g)):
            for t0 in range(0, s, chunk):
                real = list(range(t0, min(t0 + chunk, s)))
                pad = chunk - len(real)
                for i in real:
                    logits = np.array([queries[0, hq, lo + i] @ keys[0, kv, lo + c] for c in real] + [-1e-9] * pad)
                    p = np.exp(logits - logits.max())
                    per_head[j, real] += (p / p.sum())[: len(real)]
                if pad:  # a padded query row: logit 0 on every real key, -1e-9 on the padding
                    logits = np.array([0.0] * len(real) + [-1e-9] * pad)
                    p = np.exp(logits - logits.max())
                    per_head[j, real] += pad * (p / p.sum())[: len(real)]
        a = per_head.mean(axis=0) * np.linalg.norm(values[0, kv, lo:hi], axis=-1)
        padded = np.concatenate([[0.0], a, [0.0]])
        attn[kv] = (padded[:-2] + padded[1:-1] + padded[2:]) / 3
    core = blending * znorm(lev) + znorm(attn)
    out = np.full((1, kvh, n), core.max())
    out[0, :, lo:hi] = core
    return out


def observation(keys, values, queries, rotary, *, prefill=True, state=None, positions=None, seed=0):
    b, kvh, n, _ = keys.shape
    positions = torch.arange(n).expand(b, kvh, n) if positions is None else positions
    return Observation(layer=3, num_layers=4, step=0 if prefill else 1, prefill=prefill, positions=positions,
                       keys=keys, attention=None, state=state, seed=seed, queries=queries, values=values, rotary=rotary)


@pytest.mark.parametrize("n, chunk, budget", [(60, 16, 30), (64, 13, 20), (40, 256, 25)])
def test_scores_equal_a_plain_loop(n, chunk, budget):
    gen = torch.Generator().manual_seed(n)
    kvh, h, d = 2, 4, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    at = torch.arange(n).float().unsqueeze(-1) * inv_freq
    keys = rotate(torch.randn(1, kvh, n, d, generator=gen), at)
    values = torch.randn(1, kvh, n, d, generator=gen)
    queries = rotate(torch.randn(1, h, n, d, generator=gen), at)
    policy = build_policy("compactor", budget, {"chunk_size": str(chunk), "sketch_dimension": "6"})
    scores, state = policy.score(observation(keys, values, queries, inv_freq))
    phi = sketch(1, kvh, d, 6, seed=0, layer=3).double().numpy()
    expected = reference(keys.double().numpy(), values.double().numpy(), queries.double().numpy(),
                         inv_freq.double().numpy(), phi, chunk, 1 - budget / n)
    assert torch.isinf(scores[..., :8]).all() and torch.isinf(scores[..., -4:]).all()
    np.testing.assert_allclose(state.numpy(), expected, rtol=1e-3, atol=1e-4)
    kept = select_keep(scores, budget)[0].numpy()
    expected[0, :, :8] = expected[0, :, -4:] = np.inf
    np.testing.assert_array_equal(kept, np.sort(np.argsort(-expected[0], axis=-1, kind="stable")[:, :budget], axis=-1))


def test_a_key_off_the_others_subspace_has_the_top_leverage():
    """Keys in span(e1, e2) but one along e5: with a large blending it is the one kept beside the sinks."""
    gen = torch.Generator().manual_seed(0)
    n, d = 40, 8
    keys = torch.zeros(1, 1, n, d)
    keys[..., :2] = torch.randn(1, 1, n, 2, generator=gen)
    keys[0, 0, 20] = torch.eye(d)[4]
    values = torch.ones(1, 1, n, d)
    queries = torch.randn(1, 2, n, d, generator=gen) * 0.1
    policy = build_policy("compactor", 13, {"blending": "10"})
    scores, _ = policy.score(observation(keys, values, queries, None))
    assert select_keep(scores, 13)[0, 0].tolist() == list(range(8)) + [20] + list(range(36, 40))


def test_the_sketch_is_seeded_and_deterministic():
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(1, 2, 50, 8, generator=gen), torch.randn(1, 2, 50, 8, generator=gen)
    queries = torch.randn(1, 4, 50, 8, generator=gen)
    policy = build_policy("compactor", 20, {"sketch_dimension": "4"})
    a, _ = policy.score(observation(keys, values, queries, None, seed=7))
    b, _ = policy.score(observation(keys, values, queries, None, seed=7))
    c, _ = policy.score(observation(keys, values, queries, None, seed=8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_layer_sketches_are_the_draws_kvpress_makes_after_seeding_the_global_rng():
    """CompactorPress draws ``torch.randn(b, h, d, k) / sqrt(k)`` at each layer, in layer order."""
    torch.manual_seed(3)
    theirs = [torch.randn(1, 2, 8, 4) * (1 / math.sqrt(4)) for _ in range(5)]
    ours = [sketch(1, 2, 8, 4, seed=3, layer=layer) for layer in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not torch.equal(ours[1], ours[2])


def test_decode_keeps_prefill_scores_protects_the_newest_and_scores_decoded_slots_zero():
    n = 20
    positions = torch.arange(n).expand(1, 2, n).clone()
    positions[..., -1] = 30  # the new slot; positions 21..29 were evicted or moved
    positions[..., 5] = 26  # a decoded slot, no longer among the newest 4
    state = torch.linspace(-2, 2, n).expand(1, 2, n).clone()
    state[..., -1] = 0
    state[..., 5] = 0
    policy = build_policy("compactor", 19)
    scores, new_state = policy.score(observation(torch.zeros(1, 2, n, 8), torch.zeros(1, 2, n, 8), None, None,
                                                 prefill=False, state=state, positions=positions))
    assert torch.equal(new_state, state)
    protected = (positions < 8) | (positions > 30 - 4)
    assert torch.isinf(scores[protected]).all() and torch.equal(scores[~protected], state[~protected])
    assert scores[0, 0, 5] == 0


@pytest.mark.parametrize(("options", "field"), [
    ({"sink_size_start": "-1"}, "sink_size_start"), ({"sink_size_end": "-2"}, "sink_size_end"),
    ({"chunk_size": "0"}, "chunk_size"), ({"sketch_dimension": "0"}, "sketch_dimension"),
    ({"blending": "-0.5"}, "blending"), ({"blending": "lots"}, "blending"), ({"blending": "inf"}, "blending"),
    ({"sketch_dim": "8"}, "sketch_dim"),
])
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        build_policy("compactor", 8, options)


def test_blending_none_or_a_number():
    assert build_policy("compactor", 8, {"blending": "none"}).blending is None
    assert build_policy("compactor", 8, {"blending": "0.35"}).blending == 0.35


def test_registry_lists_it_with_its_paper():
    cls = get_policy_class("compactor")
    assert cls in list_policies() and cls.evicts and "Compactor" in cls.summary
    assert "2507.08143" in sys.modules[cls.__module__].__doc__


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_budget_holds_per_layer_and_head_at_every_step(family):
    assert_budget_holds(build_policy("compactor", 16, {"chunk_size": "8"}), family)


@pytest.mark.parametrize("options", [{}, {"chunk_size": "16"}])
@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_prefill_keeps_the_same_sets(chunk, options):
    assert_chunked_equals_one_prefill(build_policy("compactor", 30, options), chunk)
