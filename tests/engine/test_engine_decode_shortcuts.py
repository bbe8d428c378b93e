"""The decode step's shortcuts keep exactly what the scored path keeps.

At tier 0 a decode step that drops one slot per head moves the last slot into the hole without gathering the
evicted positions (:meth:`SlotBuffers.evict_one`), and ``streaming`` picks that slot from the positions alone
(:meth:`Policy.evict_one`). Kept positions and tokens must equal those of the scored path (tier 2, which
records every eviction, and tier 0 with the policy's shortcut switched off).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import KV_HEADS, kept_after_step, prompt_ids, run

from sparseety.engine.cache import SparseLayer
from sparseety.engine.context import RunContext
from sparseety.policies import build_policy
from sparseety.policies.base import Observation, Policy, select_evict
from sparseety.policies.streaming import StreamingPolicy

PROMPT, NEW = 30, 8
POLICIES = [("streaming", {}), ("streaming", {"sinks": 0}), ("h2o", {}), ("snapkv", {"window": 4}), ("tova", {})]


def slot_positions(engine, ids, policy, monkeypatch, **kwargs) -> tuple[list[int], list[list[torch.Tensor]]]:
    """Output ids, and after every forward each layer's ``[b, kv_heads, slots]`` positions in slot order."""
    seen: list[list[torch.Tensor]] = []
    end_forward = RunContext.end_forward

    def spy(ctx: RunContext) -> None:
        end_forward(ctx)
        seen.append([layer.positions.clone() for layer in ctx.cache.layers])

    with monkeypatch.context() as m:
        m.setattr(RunContext, "end_forward", spy)
        result = run(engine, ids, policy, NEW, **kwargs)
    return result.output_ids, seen


@pytest.mark.parametrize(("name", "options"), POLICIES)
def test_tier_0_keeps_after_every_step_what_tier_2_records(name, options, engine_for, monkeypatch):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    policy = build_policy(name, 12, options)
    logged = run(engine, ids, policy, NEW, tier=2)
    _, steps = slot_positions(engine, ids, policy, monkeypatch, tier=0)
    for step, layers in enumerate(steps):
        for layer, positions in enumerate(layers):
            for head in range(KV_HEADS):
                expected = kept_after_step(logged, layer, head, step, PROMPT + step)
                assert sorted(positions[0, head].tolist()) == sorted(expected), (layer, head, step)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize(("budget", "sinks"), [(12, 4), (10, 0), (5, 4)])
def test_streamings_shortcut_keeps_and_generates_what_its_scores_do(family, budget, sinks, engine_for, monkeypatch):
    engine, ids = engine_for(family), prompt_ids(PROMPT)
    policy = build_policy("streaming", budget, {"sinks": sinks})
    fast = slot_positions(engine, ids, policy, monkeypatch, tier=0)
    monkeypatch.setattr(StreamingPolicy, "evict_one", Policy.evict_one)
    scored = slot_positions(engine, ids, policy, monkeypatch, tier=0)
    assert fast[0] == scored[0]
    for fast_layers, scored_layers in zip(fast[1], scored[1], strict=True):  # the same slots, in the same order
        assert all(torch.equal(a, b) for a, b in zip(fast_layers, scored_layers, strict=True))


@pytest.mark.parametrize("sinks", [0, 1, 4])
def test_streamings_evict_one_is_select_evict_over_its_scores(sinks):
    generator = torch.Generator().manual_seed(sinks)
    policy = StreamingPolicy(budget=9, sinks=sinks)
    for _ in range(20):  # positions in any slot order, distinct per head
        positions = torch.stack([torch.randperm(40, generator=generator)[:10] for _ in range(6)]).view(2, 3, 10)
        obs = Observation(layer=0, num_layers=1, step=1, prefill=False, positions=positions,
                          keys=torch.zeros(2, 3, 10, 4), attention=None, state=None, seed=0)
        scores, _ = policy.score(obs)
        assert torch.equal(policy.evict_one(positions, 40), select_evict(scores, 9, positions))


@pytest.mark.parametrize(("b", "kvh"), [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_evict_one_moves_each_heads_last_slot_into_its_hole(b, kvh):
    layer = SparseLayer()
    keys = torch.randn(b, kvh, 7, 4)
    layer.update(keys, -keys)
    layer.state = torch.rand(b, kvh, 7)
    expected = [[layer.positions[i, h].tolist() for h in range(kvh)] for i in range(b)]
    state = layer.state.clone()
    slots = torch.randint(0, 7, (b, kvh, 1), generator=torch.Generator().manual_seed(b * 10 + kvh))
    slots[0, 0, 0] = 6  # the last slot itself: nothing moves
    for i in range(b):
        for h in range(kvh):
            row, s = expected[i][h], int(slots[i, h, 0])
            row[s] = row[-1]
            del row[-1]
            state[i, h, s] = state[i, h, -1]
    layer.evict_one(slots)
    assert layer.num_slots() == 6 and layer.positions.tolist() == expected
    assert torch.equal(layer.state, state[..., :6])
    for i in range(b):
        for h in range(kvh):
            for slot, position in enumerate(expected[i][h]):
                assert torch.equal(layer.keys[i, h, slot], keys[i, h, position])
                assert torch.equal(layer.values[i, h, slot], -keys[i, h, position])
