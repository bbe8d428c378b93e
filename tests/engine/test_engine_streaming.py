"""StreamingLLM: kept positions are exactly the sinks plus the last ``budget - sinks`` positions,
in every layer and KV head, after every step."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import KV_HEADS, kept_after_step, prompt_ids, run

from sparseety.policies import build_policy

PROMPT, NEW = 30, 8


def streaming_set(seen: int, budget: int, sinks: int) -> set[int]:
    if seen <= budget:
        return set(range(seen))
    return set(range(sinks)) | set(range(seen - (budget - sinks), seen))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe"])
@pytest.mark.parametrize(("budget", "sinks"), [(12, 4), (10, 0), (6, 6), (9, 1), (33, 4)])
def test_streaming_kept_set_at_every_step(budget, sinks, family, engine_for):
    engine = engine_for(family)
    result = run(engine, prompt_ids(PROMPT), build_policy("streaming", budget, {"sinks": sinks}), NEW, tier=2)
    a = result.arrays
    if "evicted.position" in a:  # streaming scores a slot by its position; sinks are +inf, never evicted
        assert np.array_equal(a["evicted.score"], a["evicted.position"].astype(np.float32))
    for layer in range(engine.num_layers):
        for head in range(KV_HEADS):
            for step in range(NEW):
                seen = PROMPT + step
                assert kept_after_step(result, layer, head, step, seen) == streaming_set(seen, budget, sinks), (
                    f"layer {layer} head {head} step {step}")
            final = result.kept_positions_final[str(layer)][str(head)]
            assert final == sorted(streaming_set(PROMPT + NEW - 1, budget, sinks))


def test_streaming_final_kept_set_for_every_generation_length(engine_for):
    """Independent of the eviction log: stop generation after each step and read the cache itself."""
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    budget, sinks = 11, 3
    policy = build_policy("streaming", budget, {"sinks": sinks})
    longest = run(engine, ids, policy, NEW, tier=2)
    for new in range(1, NEW + 1):
        result = run(engine, ids, policy, new, tier=2)
        assert result.output_ids == longest.output_ids[:new]
        expected = sorted(streaming_set(PROMPT + new - 1, budget, sinks))
        for layer, heads in result.kept_positions_final.items():
            for head, kept in heads.items():
                assert kept == expected
                # and the log of the longest run, cut at this step, agrees with the cache
                assert kept == sorted(kept_after_step(longest, int(layer), int(head), new - 1, PROMPT + new - 1))


def test_streaming_prompt_shorter_than_budget_evicts_only_once_full(engine_for):
    engine = engine_for("llama")
    prompt, budget = 6, 10
    result = run(engine, prompt_ids(prompt, seed=9), build_policy("streaming", budget), NEW, tier=2)
    # the forward of step s holds prompt + s tokens: the first one over budget is step budget - prompt + 1
    assert result.arrays["evicted.step"].min() == budget - prompt + 1
    assert result.eviction_events == (prompt + NEW - 1 - budget) * engine.num_layers * KV_HEADS
