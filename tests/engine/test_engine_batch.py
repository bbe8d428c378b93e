"""Continuous batching: a request's tokens and trace never depend on the others in its batch.

Every test runs requests in one batch (mixed policies, prompts of different lengths, chunked
prefill, arrivals at different steps) and compares each with the same request run alone through
``SparseEngine.generate`` (plain ``model.generate``). Integer outcomes (tokens, event positions,
steps, layers, heads, kept sets, counts, byte figures, rankings) must be identical; float scores
may differ in the last bits only, because a batched matmul computes a row with a different
blocking than a one-row matmul (the margin is asserted, never loosened to hide a token change).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, prompt_ids

from sparseety.engine import EncodedInput
from sparseety.engine.batch import BatchEngine
from sparseety.engine.request import GenerationOptions, RequestStatus
from sparseety.engine.scheduler import KVLimitError
from sparseety.errors import InputError
from sparseety.policies import build_policy
from sparseety.prune_schedule import parse_prune_schedule

NEW = 10
SCORE_RTOL = 1e-4
MIXED = [  # (policy, budget, options), every deterministic policy
    ("dense", None, {}),
    ("streaming", 16, {}),
    ("h2o", 24, {}),
    ("snapkv", 20, {"window": 8}),
    ("pyramid", 20, {}),
    ("tova", 18, {}),
    ("knorm", 22, {}),
    ("random", 19, {}),
    ("topk_attention", 12, {}),
    ("keydiff", 21, {}),
    ("expected_attention", 23, {}),
    ("compactor", 25, {"chunk_size": "16"}),
    ("kvzip", 21, {"window": "4"}),
]
LENGTHS = [5, 40, 90, 17, 63, 33, 71, 28, 50, 45]

LENGTHS = LENGTHS + [45, 80, 36]  # one more prompt for each of keydiff, expected_attention, compactor


def policies():
    return [build_policy(name, budget, opts) for name, budget, opts in MIXED]


def inputs(lengths=LENGTHS):
    return [EncodedInput(prompt_ids(n, seed=n)) for n in lengths]


def assert_same_trace(alone, batched):
    """Everything a request sees is the same alone and in a batch (floats to the last bits)."""
    assert batched.output_ids == alone.output_ids
    assert batched.prompt_ids == alone.prompt_ids
    assert batched.kept_positions_final == alone.kept_positions_final
    for name in ("evicted_positions", "eviction_events", "skipped_events", "kv_cache_bytes_peak",
                 "kv_cache_bytes_dense", "pruned_tokens", "extraction_layers"):
        assert getattr(batched, name) == getattr(alone, name), name
    assert set(batched.arrays) == set(alone.arrays)
    for key, a in alone.arrays.items():
        b = batched.arrays[key]
        if np.issubdtype(a.dtype, np.integer) or a.dtype == bool:
            np.testing.assert_array_equal(b, a, err_msg=key)
        else:
            np.testing.assert_allclose(b.astype(np.float64), a.astype(np.float64), rtol=SCORE_RTOL, atol=1e-3,
                                       err_msg=key)
    ranked = [(r.layer, r.position, r.rank) for r in alone.important_tokens]
    assert [(r.layer, r.position, r.rank) for r in batched.important_tokens] == ranked


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_in_a_batch_equals_plain_generate(family, engine_for, greedy_reference):
    encoded = inputs([5, 40, 90, 1, 33])
    results = engine_for(family).generate_batch(encoded, build_policy("dense"),
                                                GenerationOptions(max_new_tokens=NEW, tier=3), prefill_chunk=32)
    for e, result in zip(encoded, results):
        assert result.output_ids == greedy_reference(family, e.input_ids, NEW), f"prompt of {e.input_len} tokens"


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "gemma3"])
def test_every_policy_in_one_batch_equals_each_alone(family, engine_for):
    engine = engine_for(family)
    encoded, pols = inputs(), policies()
    options = GenerationOptions(max_new_tokens=NEW, tier=3)
    # On the hybrid model a chunk edge changes the sliding layers' SDPA blocking (keys the window hid are
    # absent instead of masked), a float difference knorm's near-tied key norms amplify on random weights;
    # its chunked prefill is checked policy by policy in test_engine_window.py. Here: packing only.
    chunk = 4096 if family == "gemma3" else 24
    batched = engine.generate_batch(encoded, pols, options, prefill_chunk=chunk)
    for e, p, b in zip(encoded, pols, batched):
        alone = engine.generate(e, p, max_new_tokens=NEW, tier=3)
        assert_same_trace(alone, b)
    assert any(b.eviction_events for b in batched) and any("router.0" in b.arrays for b in batched) == (family == "qwen2_moe")


def test_requests_arriving_at_any_step_see_the_same(engine_for):
    engine = engine_for("llama")
    encoded, pols = inputs(), policies()
    options = GenerationOptions(max_new_tokens=NEW, tier=2)
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    results, pending, step = {}, list(enumerate(zip(encoded, pols))), 0
    while pending or batch.has_work():
        if pending and step % 3 == 0:  # a new request every third step, joining running decodes
            i, (e, p) = pending.pop(0)
            batch.add(e, p, options, request_id=str(i))
        for out in batch.step():
            assert batch.running <= 4
            if out.result is not None:
                results[int(out.request.request_id)] = out.result
        step += 1
    for i, (e, p) in enumerate(zip(encoded, pols)):
        assert_same_trace(engine.generate(e, p, max_new_tokens=NEW, tier=2), results[i])


@pytest.mark.parametrize("name, budget, opts", [
    ("h2o", 30, {}), ("h2o", 30, {"prefill_rows": 16}), ("snapkv", 30, {"window": 12}), ("pyramid", 30, {"window": 12}),
    ("tova", 30, {}), ("streaming", 30, {}), ("kvzip", 30, {"chunk_size": "40"}),
    ("h2o", 30, {"value_aware": "true"}), ("snapkv", 30, {"window": 12, "value_aware": "true"}),
    ("tova", 30, {"value_aware": "true"}),
])
@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_prefill_keeps_the_same_sets_as_one_prefill(name, budget, opts, chunk, engine_for):
    """Chunks of 7 put the observation window across chunk edges and the sampled h2o rows at odd offsets."""
    engine = engine_for("llama")
    e, policy = EncodedInput(prompt_ids(100, seed=9)), build_policy(name, budget, opts)
    alone = engine.generate(e, policy, max_new_tokens=NEW, tier=3)
    (chunked,) = engine.generate_batch([e], policy, GenerationOptions(max_new_tokens=NEW, tier=3), prefill_chunk=chunk)
    assert_same_trace(alone, chunked)
    assert (alone.arrays["evicted.step"] == 0).any()  # the prefill itself evicted: its scoring was exercised


def test_long_document_pruning_topk_and_layer_selection_compose_in_a_batch(engine_for):
    engine = engine_for("llama")
    context, question = prompt_ids(80, seed=3)[0].tolist(), prompt_ids(6, seed=4)[0].tolist()
    document = EncodedInput(torch.tensor([context + question]), compress_len=len(context))
    cases = [
        (document, build_policy("snapkv", 24, {"window": 8}), GenerationOptions(max_new_tokens=NEW, tier=2)),
        (EncodedInput(prompt_ids(60, seed=5)), build_policy("h2o", 20),
         GenerationOptions(max_new_tokens=NEW, tier=2, prune=parse_prune_schedule("1:0.5", {"keep_recent": 4}, 4))),
        (EncodedInput(prompt_ids(45, seed=6)), build_policy("streaming", 20),
         GenerationOptions(max_new_tokens=NEW, tier=3, attention_topk=8)),
        (EncodedInput(prompt_ids(50, seed=7)), build_policy("dense"),
         GenerationOptions(max_new_tokens=NEW, tier=2, layers="auto")),
    ]
    batched = engine.generate_batch([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases],
                                    prefill_chunk=16)
    for (e, p, o), b in zip(cases, batched):
        alone = engine.generate(e, p, max_new_tokens=o.max_new_tokens, tier=o.tier, prune=o.prune,
                                attention_topk=o.attention_topk, layers=o.layers)
        assert_same_trace(alone, b)
    assert batched[1].pruned_tokens and batched[2].skipped_events and len(batched[3].extraction_layers) == 1


def test_a_cancelled_request_leaves_at_once_and_frees_its_reservation(engine_for):
    engine = engine_for("llama")
    batch = BatchEngine(engine, max_batch=8, prefill_chunk=64)
    encoded, options = inputs([30, 30, 30]), GenerationOptions(max_new_tokens=NEW, tier=2)
    requests = [batch.add(e, build_policy("streaming", 16), options, request_id=f"r{i}") for i, e in enumerate(encoded)]
    for _ in range(3):
        batch.step()
    held = batch.reserved_bytes
    gone = batch.abort("r1")
    assert gone is requests[1] and gone.status is RequestStatus.FINISHED_ABORTED and gone.ctx is None
    assert batch.reserved_bytes == held - requests[1].reserved_bytes and batch.running == 2
    results = batch.run()
    assert sorted(results) == ["r0", "r2"]
    alone = engine.generate(encoded[0], build_policy("streaming", 16), max_new_tokens=NEW, tier=2)
    assert_same_trace(alone, results["r0"])
    assert batch.reserved_bytes == 0 and not batch.has_work()


def test_admission_reserves_worst_case_kv_bytes(engine_for):
    engine = engine_for("llama")
    e = EncodedInput(prompt_ids(100, seed=2))
    dense = engine.reserved_kv_bytes(e, build_policy("dense"), 20)
    sparse = engine.reserved_kv_bytes(e, build_policy("streaming", 16), 20)
    per_slot = 2 * engine.num_layers * engine.kv_heads * engine.head_dim * 4
    assert dense == (100 + 20 - 1) * per_slot and sparse == 17 * per_slot
    batch = BatchEngine(engine, max_batch=16, kv_memory_limit=2 * dense)
    for i in range(3):
        batch.add(e, build_policy("dense"), GenerationOptions(max_new_tokens=20, tier=0), request_id=f"d{i}")
    batch.step()
    assert batch.running == 2 and batch.waiting == 1  # the third waits until one finishes
    with pytest.raises(KVLimitError, match="kv_memory_limit"):
        batch.add(EncodedInput(prompt_ids(200, seed=2)), build_policy("dense"), GenerationOptions(max_new_tokens=100))
    assert sorted(batch.run()) == ["d0", "d1", "d2"]
    sparse_batch = BatchEngine(engine, max_batch=64, kv_memory_limit=2 * dense)
    for i in range(20):
        sparse_batch.add(e, build_policy("streaming", 16), GenerationOptions(max_new_tokens=20, tier=0))
    sparse_batch.step()
    assert sparse_batch.running == 2 * dense // sparse  # the same memory holds 7x as many sparse requests


def test_bad_requests_are_refused_alone_and_the_rest_run(engine_for):
    engine = engine_for("llama")
    batch = BatchEngine(engine)
    good = batch.add(EncodedInput(prompt_ids(20)), build_policy("dense"), GenerationOptions(max_new_tokens=4))
    with pytest.raises(InputError, match="exceeds the model's context"):
        batch.add(EncodedInput(prompt_ids(510)), build_policy("dense"), GenerationOptions(max_new_tokens=10))
    with pytest.raises(InputError, match="already in the batch"):
        batch.add(EncodedInput(prompt_ids(20)), build_policy("dense"), request_id=good.request_id)
    with pytest.raises(InputError, match="max_new_tokens"):
        GenerationOptions(max_new_tokens=0)
    with pytest.raises(InputError, match="generate_batch: 2 inputs but 1 policies"):
        engine.generate_batch(inputs([3, 4]), [build_policy("dense")])
    assert list(batch.run()) == [good.request_id]


def test_a_sequence_stops_at_its_end_of_sequence_token_as_generate_does(tokenizer, greedy_reference, reference_model):
    from tiny_models import build_model

    from sparseety.engine import SparseEngine

    ids = prompt_ids(30, seed=11)
    free = greedy_reference("llama", ids, NEW)
    eos = free[3]  # the fourth generated token ends the sequence once it is the end-of-sequence id
    model = build_model("llama")
    model.generation_config.eos_token_id = eos
    engine = SparseEngine(model, tokenizer, model_name="tiny-llama-eos")
    batch = BatchEngine(engine)
    stopping = batch.add(EncodedInput(ids), build_policy("dense"), GenerationOptions(max_new_tokens=NEW))
    running = batch.add(EncodedInput(prompt_ids(20, seed=12)), build_policy("dense"), GenerationOptions(max_new_tokens=NEW))
    results = batch.run()
    assert results[stopping.request_id].output_ids == free[: free.index(eos) + 1]
    assert stopping.status is RequestStatus.FINISHED_STOPPED
    assert running.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    with torch.inference_mode():
        plain = reference_model("llama").generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                                  do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert results[stopping.request_id].output_ids == plain[0, ids.shape[1]:].tolist()
