"""Engine-level checks shared by the tests of the query-agnostic policies (keydiff, expected_attention, compactor).

Runs on the tiny random-weight models of ``tests/engine/tiny_models.py`` (built in code, nothing downloaded).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tiny_models import KV_HEADS, build_model, build_tokenizer, evicted_by_head, kept_after_step, prompt_ids  # noqa: E402

from sparseety.engine import EncodedInput, SparseEngine  # noqa: E402
from sparseety.engine.request import GenerationOptions  # noqa: E402

_ENGINES: dict[str, SparseEngine] = {}


def engine(family: str = "llama") -> SparseEngine:
    """One wrapped tiny engine per family for the whole session."""
    if family not in _ENGINES:
        _ENGINES[family] = SparseEngine(build_model(family), build_tokenizer(), model_name=f"tiny-{family}")
    return _ENGINES[family]


def assert_budget_holds(policy, family: str = "llama", prompt: int = 40, new: int = 10) -> None:
    """Every (layer, kv_head) holds ``min(budget, seen)`` slots after every step; one eviction per decode step."""
    eng = engine(family)
    budget = policy.budget
    result = eng.generate(EncodedInput(prompt_ids(prompt)), policy, max_new_tokens=new, tier=2)
    a = result.arrays
    assert len(result.output_ids) == new
    assert np.isfinite(a["evicted.score"]).all(), "a protected (+inf) slot was evicted"
    token_ids = np.asarray(result.token_ids)
    assert np.array_equal(a["evicted.token_id"], token_ids[a["evicted.position"]])
    for layer in range(eng.num_layers):
        for head in range(KV_HEADS):
            positions, steps = evicted_by_head(result, layer, head)
            assert len(set(positions.tolist())) == positions.size, "a position was evicted twice"
            for step in range(new):
                seen = prompt + step
                expected = max(0, prompt - budget) if step == 0 else int(seen > budget)
                assert (steps == step).sum() == expected, (layer, head, step)
                assert len(kept_after_step(result, layer, head, step, seen)) == min(budget, seen)
            kept = result.kept_positions_final[str(layer)][str(head)]
            assert len(kept) == budget and len(kept) + positions.size == prompt + new - 1


def assert_chunked_equals_one_prefill(policy, chunk: int, family: str = "llama", prompt: int = 100, new: int = 10) -> None:
    """A prefill in chunks of ``chunk`` keeps exactly the sets one prefill keeps (tokens, events, kept sets)."""
    eng = engine(family)
    e = EncodedInput(prompt_ids(prompt, seed=9))
    alone = eng.generate(e, policy, max_new_tokens=new, tier=3)
    (chunked,) = eng.generate_batch([e], policy, GenerationOptions(max_new_tokens=new, tier=3), prefill_chunk=chunk)
    assert chunked.output_ids == alone.output_ids
    assert chunked.kept_positions_final == alone.kept_positions_final
    for key in ("evicted.step", "evicted.layer", "evicted.kv_head", "evicted.position"):
        np.testing.assert_array_equal(chunked.arrays[key], alone.arrays[key], err_msg=key)
    np.testing.assert_allclose(chunked.arrays["evicted.score"], alone.arrays["evicted.score"], rtol=1e-4, atol=1e-3)  # the batch tests' margin
    assert (alone.arrays["evicted.step"] == 0).any()  # the prefill itself evicted: its scoring was exercised
