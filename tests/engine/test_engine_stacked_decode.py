"""Decode evictions stacked over the layers keep exactly what each layer's own eviction keeps.

At tier 0, once every layer holds its budget, a decode step evicts every layer at the end of the forward
with one chain of ops over stacked buffers (:mod:`sparseety.engine.stacked`). The tokens, the slots after
every forward (in slot order), the policy's state and the keys and values must equal those of the
per-layer path (the stacked path switched off).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt_ids, run

import sparseety.engine.context as context_module
from sparseety.engine.context import RunContext
from sparseety.policies import build_policy

PROMPT, NEW = 30, 10
POLICIES = [("streaming", {}), ("h2o", {}), ("h2o", {"recent_ratio": 0.0}), ("snapkv", {"window": 4}),
            ("tova", {}), ("tova", {"heads": "kv_head"}), ("h2o", {"value_aware": True}), ("pyramid", {"window": 4})]


def trace(engine, ids, policy, monkeypatch, stacked: bool, budget_steps: list[bool] | None = None):
    """Output ids and, after every forward, each layer's positions, state, keys and values (clones)."""
    after: list[list[tuple]] = []
    end_forward = RunContext.end_forward

    def spy(ctx: RunContext) -> None:
        if budget_steps is not None:
            budget_steps.append(ctx.forward.stacked)
        end_forward(ctx)
        after.append([tuple(None if x is None else x.clone() for x in (layer.positions, layer.state, layer.keys,
                                                                         layer.values)) for layer in ctx.cache.layers])

    with monkeypatch.context() as m:
        m.setattr(RunContext, "end_forward", spy)
        if not stacked:
            m.setattr(context_module, "stacked_step", lambda ctx, q_len: False)
        result = run(engine, ids, policy, NEW, tier=0)
    return result.output_ids, after


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    for step, (layers_a, layers_b) in enumerate(zip(a[1], b[1], strict=True)):
        for layer, (x, y) in enumerate(zip(layers_a, layers_b, strict=True)):
            for what, u, v in zip(("positions", "state", "keys", "values"), x, y, strict=True):
                assert (u is None) == (v is None) and (u is None or torch.equal(u, v)), (step, layer, what)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize(("name", "options"), POLICIES)
@pytest.mark.parametrize("budget", [12, 33])  # 33: the prompt fits, the layers reach the budget while decoding
def test_stacked_evictions_keep_what_each_layers_own_do(family, name, options, budget, engine_for, monkeypatch):
    engine, ids = engine_for(family), prompt_ids(PROMPT)
    policy = build_policy(name, budget, options)
    used: list[bool] = []
    stacked = trace(engine, ids, policy, monkeypatch, stacked=True, budget_steps=used)
    per_layer = trace(engine, ids, policy, monkeypatch, stacked=False)
    assert_same(stacked, per_layer)
    expected = family != "gemma3" and policy.stacks_decode()  # gemma3 has sliding layers: per layer
    assert any(used) == expected
    if expected:  # every decode step once every layer holds its budget
        assert used == [0 < i and PROMPT + i > budget for i in range(NEW)]


def test_a_step_that_breaks_the_stack_falls_back_and_restacks(engine_for, monkeypatch):
    """A layer reallocated between steps (here: by a large eviction) leaves the stack; the next step stacks again."""
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    policy = build_policy("h2o", 12, {})
    reference = trace(engine, ids, policy, monkeypatch, stacked=False)
    stacks: list[object] = []
    end_forward = RunContext.end_forward

    def spy(ctx: RunContext) -> None:
        end_forward(ctx)
        stacks.append(ctx.stack)
        if ctx.forward.step == 3:  # move layer 1 out of the stack, as growing its buffer would
            layer = ctx.cache.layers[1]
            layer._reallocate(layer.capacity())

    with monkeypatch.context() as m:
        m.setattr(RunContext, "end_forward", spy)
        result = run(engine, ids, policy, NEW, tier=0)
    assert result.output_ids == reference[0]
    assert stacks[3] is not None and stacks[4] is not None and stacks[4] is not stacks[3]
