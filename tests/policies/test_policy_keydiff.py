"""``keydiff``: exact kept sets on constructed keys, kvpress's scoring against a plain loop, budgets and chunking in the engine."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from kv_policy_checks import assert_budget_holds, assert_chunked_equals_one_prefill
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.errors import ConfigError
from sparseety.policies import build_policy, get_policy_class, list_policies
from sparseety.policies.base import Observation, Signal, select_keep


def observation(keys: torch.Tensor, prefill: bool = True) -> Observation:
    b, h, n, _ = keys.shape
    return Observation(layer=0, num_layers=1, step=0, prefill=prefill, positions=torch.arange(n).expand(b, h, n),
                       keys=keys, attention=None, state=None, seed=0)


def reference(keys: np.ndarray) -> np.ndarray:
    """A plain loop: minus the cosine of each key to the mean of the unit keys of its head."""
    b, h, n, _ = keys.shape
    out = np.zeros((b, h, n))
    for i in range(b):
        for j in range(h):
            unit = [k / np.linalg.norm(k) for k in keys[i, j]]
            anchor = np.mean(unit, axis=0)
            for s in range(n):
                k = keys[i, j, s]
                out[i, j, s] = -float(k @ anchor) / (np.linalg.norm(k) * np.linalg.norm(anchor))
    return out


def test_keys_far_from_the_mean_key_are_kept():
    """Ten keys along e1 (with different norms and a little noise) and three odd ones: the odd ones are kept."""
    d = 8
    keys = torch.zeros(1, 2, 13, d)
    gen = torch.Generator().manual_seed(0)
    keys[..., 0] = torch.linspace(1, 5, 13)  # norm does not matter, direction does
    keys[..., 1:] = 0.01 * torch.randn(1, 2, 13, d - 1, generator=gen)
    keys[0, 0, 3], keys[0, 0, 7], keys[0, 0, 11] = torch.eye(d)[2], -torch.eye(d)[0], torch.eye(d)[4]
    keys[0, 1, 0], keys[0, 1, 12], keys[0, 1, 6] = torch.eye(d)[1], torch.eye(d)[3], -torch.eye(d)[0]
    policy = build_policy("keydiff", 3)
    scores, state = policy.score(observation(keys))
    assert state is None
    kept = select_keep(scores, 3)
    assert kept[0, 0].tolist() == [3, 7, 11]
    assert kept[0, 1].tolist() == [0, 6, 12]


def test_equal_keys_tie_and_the_lower_position_is_kept():
    keys = torch.ones(1, 1, 6, 4)
    keys[0, 0, 2] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    scores, _ = build_policy("keydiff", 3).score(observation(keys))
    assert select_keep(scores, 3)[0, 0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_equal_a_plain_loop_and_rank_the_same(seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, 50, 16, generator=gen) + torch.randn(1, 3, 1, 16, generator=gen)
    scores, _ = build_policy("keydiff", 20).score(observation(keys))
    expected = reference(keys.double().numpy())
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-5, atol=1e-6)
    kept = select_keep(scores, 20)
    expected_kept = np.sort(np.argsort(-expected, axis=-1, kind="stable")[..., :20], axis=-1)
    np.testing.assert_array_equal(kept.numpy(), expected_kept)


def test_decode_rescores_every_slot_against_the_current_anchor():
    """No state: a decode step scores the held keys exactly as a prefill over them would."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 17, 8, generator=gen)
    policy = build_policy("keydiff", 16)
    decode, state = policy.score(observation(keys, prefill=False))
    prefill, _ = policy.score(observation(keys))
    assert state is None and torch.equal(decode, prefill)


def test_contract_registry_and_cli():
    cls = get_policy_class("keydiff")
    assert cls in list_policies() and cls.prefill_signal is Signal.NONE and cls.decode_signal is Signal.NONE
    assert cls.evicts and "KeyDiff" in cls.summary and "2504.15364" in sys.modules[cls.__module__].__doc__
    with pytest.raises(ConfigError, match="keydiff: unknown option 'window'"):
        build_policy("keydiff", 8, {"window": "4"})
    with pytest.raises(ConfigError, match="budget"):
        build_policy("keydiff", 0)
    with pytest.raises(ConfigError, match="budget"):
        build_policy("keydiff")
    listing = CliRunner().invoke(app, ["policies", "list"])
    assert listing.exit_code == 0 and "keydiff" in listing.output


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_budget_holds_per_layer_and_head_at_every_step(family):
    assert_budget_holds(build_policy("keydiff", 16), family)


@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_prefill_keeps_the_same_sets(chunk):
    assert_chunked_equals_one_prefill(build_policy("keydiff", 30), chunk)
