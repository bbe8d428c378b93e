"""Each policy's ``score`` on small hand-made tensors, through an :class:`Observation`."""

from __future__ import annotations

import pytest
import torch

from sparseety.engine.context import group_mean
from sparseety.errors import ConfigError
from sparseety.policies import Observation, build_policy, select_keep
from sparseety.policies.snapkv import window_vote


def observation(n: int, *, kv_heads: int = 1, attention=None, keys=None, state=None, layer: int = 0,
                step: int = 0, seed: int = 0, positions=None) -> Observation:
    if positions is None:
        positions = torch.arange(n).expand(1, kv_heads, n)
    if keys is None:
        keys = torch.ones(1, kv_heads, n, 4)
    return Observation(layer=layer, num_layers=4, step=step, prefill=step == 0, positions=positions, keys=keys,
                       attention=attention, state=state, seed=seed)


def kept(policy, obs: Observation, budget: int | None = None) -> list[list[int]]:
    scores, _ = policy.score(obs)
    keep = select_keep(scores, budget or policy.budget)
    return obs.positions.gather(-1, keep)[0].tolist()


def test_streaming_keeps_sinks_and_newest():
    policy = build_policy("streaming", 5, {"sinks": 2})
    assert kept(policy, observation(12)) == [[0, 1, 9, 10, 11]]
    positions = torch.tensor([[[0, 1, 7, 8, 9, 12]]])  # a compacted cache: positions are not contiguous
    assert kept(policy, observation(6, positions=positions)) == [[0, 1, 8, 9, 12]]


def test_h2o_keeps_heavy_hitters_plus_recent_window():
    policy = build_policy("h2o", 5, {"recent_ratio": 0.4})  # recent window int(5 * 0.4) = 2
    attention = torch.full((1, 1, 10), 0.01)
    attention[0, 0, [1, 4, 6]] = torch.tensor([0.5, 0.3, 0.2])
    attention[0, 0, 2] = 0.15
    scores, state = policy.score(observation(10, attention=attention))
    assert torch.isinf(scores[0, 0, 8:]).all() and torch.isfinite(scores[0, 0, :8]).all()
    assert torch.equal(state, attention)
    assert select_keep(scores, 5)[0].tolist() == [[1, 4, 6, 8, 9]]


def test_h2o_accumulates_attention_over_steps():
    policy = build_policy("h2o", 3, {"recent_ratio": 0.34})  # recent window 1
    state = torch.tensor([[[0.5, 0.4, 0.3, 0.0]]])  # slot 3 is new
    attention = torch.tensor([[[0.0, 0.05, 0.3, 0.65]]])
    before = state.clone()
    scores, new_state = policy.score(observation(4, attention=attention, state=state, step=1))
    assert torch.allclose(new_state, before + attention)
    assert new_state.data_ptr() == state.data_ptr()  # accumulated in place: no copy per decode step
    # accumulated: 0.5, 0.45, 0.6, newest protected -> the middle heavy-hitter of this step overtakes slot 1
    assert select_keep(scores, 3)[0].tolist() == [[0, 2, 3]]


def test_snapkv_window_vote_pools_and_protects_the_window():
    n, w = 12, 3
    attention = torch.zeros(1, 1, w, n)
    attention[0, 0, :, 2] = 1.0 / 3  # all three window rows vote for position 2 (total 1.0)
    attention[0, 0, :, 6] = 0.1 / 3  # a weaker vote for position 6 (total 0.1)
    plain = build_policy("snapkv", 6, {"window": w, "kernel": 1})
    scores, votes = plain.score(observation(n, attention=attention))
    assert torch.allclose(votes[0, 0], attention[0, 0].sum(dim=0))
    assert torch.isinf(scores[0, 0, n - w:]).all() and torch.isfinite(scores[0, 0, : n - w]).all()
    # no pooling: the two voted tokens, then the lowest-position zero-vote slot, then the window
    assert select_keep(scores, 6)[0].tolist() == [[0, 2, 6, 9, 10, 11]]
    pooled = build_policy("snapkv", 6, {"window": w, "kernel": 3})
    scores, votes = pooled.score(observation(n, attention=attention))
    # pooling spreads position 2's vote to its neighbours, which now beat position 6
    assert torch.allclose(votes[0, 0, 1:4], torch.full((3,), 1.0 / 3))
    assert select_keep(scores, 6)[0].tolist() == [[1, 2, 3, 9, 10, 11]]


def test_snapkv_pooling_excludes_padding_at_the_edges():
    votes = torch.tensor([[[[3.0, 1.0, 0.0, 0.0, 2.0]]]])
    pooled = window_vote(votes, kernel=3)[0, 0]
    assert torch.allclose(pooled, torch.tensor([2.0, 4.0 / 3, 1.0 / 3, 2.0 / 3, 1.0]))


def test_tova_evicts_the_lowest_group_averaged_attention():
    # two query heads per KV head; each head alone would evict a different slot than their mean
    per_head = torch.tensor([[[0.10, 0.50, 0.40], [0.60, 0.10, 0.30],   # group 0 -> mean 0.35 0.30 0.35
                              [0.20, 0.20, 0.60], [0.00, 0.50, 0.50]]])  # group 1 -> mean 0.10 0.35 0.55
    grouped = group_mean(per_head, kv_heads=2)
    assert torch.allclose(grouped, torch.tensor([[[0.35, 0.30, 0.35], [0.10, 0.35, 0.55]]]))
    policy = build_policy("tova", 2, {"heads": "kv_head"})
    scores, state = policy.score(observation(3, kv_heads=2, attention=grouped))
    assert state is None
    assert select_keep(scores, 2)[0].tolist() == [[0, 2], [1, 2]]


def test_tova_layer_mode_keeps_one_set_from_the_mean_over_all_heads():
    grouped = torch.tensor([[[0.35, 0.30, 0.35], [0.10, 0.35, 0.55]]])  # layer mean: 0.225 0.325 0.45
    scores, _ = build_policy("tova", 2).score(observation(3, kv_heads=2, attention=grouped))
    assert select_keep(scores, 2)[0].tolist() == [[1, 2], [1, 2]]
    with pytest.raises(ConfigError, match="tova: heads must be one of layer, kv_head, got 'query'"):
        build_policy("tova", 2, {"heads": "query"})


def test_knorm_keeps_lowest_norm_keys():
    norms = torch.tensor([[3.0, 1.0, 2.0, 5.0, 0.5], [0.1, 4.0, 4.0, 0.2, 9.0]])
    direction = torch.tensor([0.6, 0.0, 0.8, 0.0])  # unit vector
    keys = (norms[..., None] * direction).unsqueeze(0)  # [1, 2, 5, 4]
    policy = build_policy("knorm", 2)
    assert kept(policy, observation(5, kv_heads=2, keys=keys)) == [[1, 4], [0, 3]]


def test_random_is_reproducible_by_seed_and_differs_across_seeds():
    obs = observation(64, kv_heads=2)
    policy = build_policy("random", 8)
    first, _ = policy.score(obs)
    assert torch.equal(first, build_policy("random", 8).score(obs)[0])
    assert not torch.equal(first, build_policy("random", 8, {"seed": 1}).score(obs)[0])
    assert not torch.equal(first, policy.score(observation(64, kv_heads=2, seed=7))[0])  # run seed
    assert not torch.equal(first, policy.score(observation(64, kv_heads=2, layer=1))[0])
    assert not torch.equal(first, policy.score(observation(64, kv_heads=2, step=3))[0])
    assert not torch.equal(first[0, 0], first[0, 1]), "heads draw independently"


def test_dense_and_topk_attention_protect_every_slot():
    for name, budget in (("dense", None), ("topk_attention", 4)):
        scores, _ = build_policy(name, budget).score(observation(6))
        assert torch.isinf(scores).all()


def test_a_policy_that_declares_it_reads_no_keys_scores_the_same_without_them():
    """vLLM's worker hands zero-width keys to these policies instead of copying keys out of its cache."""
    from sparseety.policies.registry import list_policies

    keyless = [cls.name for cls in list_policies() if not cls.reads_keys and not cls.needs_hidden]
    assert {"streaming", "random"} <= set(keyless)
    positions = torch.tensor([[[0, 1, 2, 5, 6, 9, 10, 11], [0, 1, 3, 4, 7, 8, 10, 11]]])
    for name in keyless:
        policy = build_policy(name, 5, {})
        with_keys = observation(8, kv_heads=2, positions=positions, keys=torch.randn(1, 2, 8, 4), step=3)
        without = observation(8, kv_heads=2, positions=positions, keys=torch.empty(1, 2, 8, 0), step=3)
        assert torch.equal(policy.score(with_keys)[0], policy.score(without)[0]), name
