"""Engine-level contracts: input validation, no state leaking between runs, no global patching,
and the important tokens ranked from what the run attended to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tokenizer, prompt_ids, run

from sparseety.engine import EncodedInput, encode_prompt
from sparseety.errors import InputError
from sparseety.policies import build_policy

PROMPT, NEW = 24, 6


@pytest.mark.parametrize("kwargs", [{"tier": 4}, {"tier": -1}, {"max_new_tokens": 0}, {"speculative": 0},
                                    {"max_new_tokens": 512 - PROMPT + 1}])
def test_bad_generation_arguments_raise_input_error(kwargs, engine_for):
    args = {"max_new_tokens": NEW, "tier": 2, **kwargs}
    with pytest.raises(InputError):
        engine_for("llama").generate(EncodedInput(prompt_ids(PROMPT)), build_policy("dense"), **args)


def test_prompt_filling_the_context_exactly_is_accepted(engine_for):
    result = engine_for("llama").generate(EncodedInput(prompt_ids(500)), build_policy("streaming", 32),
                                          max_new_tokens=12, tier=1)
    assert len(result.output_ids) == 12


def test_encode_prompt_rejects_empty_and_encodes_plain_text():
    tok = build_tokenizer()
    with pytest.raises(InputError):
        encode_prompt(tok, "   ", chat=False)
    encoded = encode_prompt(tok, "t5 t6 t7", chat=False)
    assert encoded.input_ids.tolist() == [[5, 6, 7]] and encoded.compress_len is None


def test_runs_do_not_leak_state(engine_for, greedy_reference):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    policy = build_policy("h2o", 10)
    first = run(engine, ids, policy, NEW, tier=3)
    run(engine, prompt_ids(PROMPT, seed=5), build_policy("snapkv", 8, {"window": "2"}), NEW, tier=3)
    second = run(engine, ids, policy, NEW, tier=3)
    assert second.output_ids == first.output_ids
    assert set(second.arrays) == set(first.arrays)
    for key, value in first.arrays.items():
        assert np.array_equal(value, second.arrays[key], equal_nan=True), key
    assert run(engine, ids, build_policy("dense"), NEW, tier=2).output_ids == greedy_reference("llama", ids, NEW)


def test_random_policy_runs_repeat_by_seed(engine_for):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    policy = build_policy("random", 10)
    a = run(engine, ids, policy, NEW, tier=2, seed=3)
    b = run(engine, ids, policy, NEW, tier=2, seed=3)
    c = run(engine, ids, policy, NEW, tier=2, seed=4)
    assert np.array_equal(a.arrays["evicted.position"], b.arrays["evicted.position"])
    assert a.kept_positions_final == b.kept_positions_final
    assert a.kept_positions_final != c.kept_positions_final


def test_the_wrapped_model_outside_a_run_still_generates_plainly(engine_for, greedy_reference):
    engine, ids = engine_for("qwen2"), prompt_ids(PROMPT)
    run(engine, ids, build_policy("streaming", 8), NEW, tier=2)
    with torch.inference_mode():
        out = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert out[0, PROMPT:].tolist() == greedy_reference("qwen2", ids, NEW)


def test_important_tokens_rank_the_attention_received(engine_for):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    top_k = 5
    result = run(engine, ids, build_policy("dense"), NEW, tier=2, top_k=top_k)
    importance = result.arrays["importance"].astype(np.float32)
    records = result.important_tokens
    overall = [r for r in records if r.layer is None]
    assert [r.rank for r in overall] == list(range(top_k))
    assert overall[0].position == int(np.argmax(importance.sum(axis=0)))
    assert all(r.token_id == result.token_ids[r.position] for r in records)
    for layer in range(engine.num_layers):
        ranking = [r for r in records if r.layer == layer]
        assert len(ranking) == top_k
        assert ranking[0].position == int(np.argmax(importance[layer]))
        assert [r.score for r in ranking] == sorted((r.score for r in ranking), reverse=True)
    assert run(engine, ids, build_policy("dense"), NEW, tier=1).important_tokens == []
