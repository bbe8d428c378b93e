"""Continuous batching on the real default model: dense equals plain generate, every request equals itself
alone, and admission turns eviction into concurrency."""

from __future__ import annotations

from pathlib import Path

import torch

from sparseety.engine import EncodedInput, encode_document, encode_prompt
from sparseety.engine.request import GenerationOptions
from sparseety.policies import build_policy

TEXT = Path("/usr/share/common-licenses/GPL-3").read_text()


def _prompts(tokenizer, count: int) -> list[EncodedInput]:
    return [encode_prompt(tokenizer, TEXT[i * 900 : i * 900 + 200 + 300 * i] + "\nSummarize the text above.", None)
            for i in range(count)]


def test_dense_batch_equals_plain_generate_with_chunked_prefill(smollm, smollm_engine):
    model, tokenizer = smollm
    encoded = _prompts(tokenizer, 4)
    assert max(e.input_len for e in encoded) > 200  # several chunks of 64
    results = smollm_engine.generate_batch(encoded, build_policy("dense"), GenerationOptions(max_new_tokens=10, tier=2),
                                           prefill_chunk=64)
    for e, result in zip(encoded, results):
        with torch.inference_mode():
            reference = model.generate(e.input_ids, attention_mask=torch.ones_like(e.input_ids), max_new_tokens=10,
                                       do_sample=False)[0, e.input_len:].tolist()
        assert result.output_ids == reference
        assert result.kv_cache_bytes_peak == result.kv_cache_bytes_dense


def test_mixed_policies_in_one_batch_equal_each_alone(smollm_engine):
    tokenizer = smollm_engine.tokenizer
    encoded = _prompts(tokenizer, 3)
    document = encode_document(tokenizer, TEXT[:1200], "What does the text say about freedom?", None)
    inputs = [*encoded, document]
    policies = [build_policy("streaming", 48), build_policy("h2o", 64), build_policy("tova", 56),
                build_policy("snapkv", 96)]
    batched = smollm_engine.generate_batch(inputs, policies, GenerationOptions(max_new_tokens=8, tier=2),
                                           prefill_chunk=64)
    for e, p, b in zip(inputs, policies, batched):
        alone = smollm_engine.generate(e, p, max_new_tokens=8, tier=2)
        assert b.output_ids == alone.output_ids
        assert b.kept_positions_final == alone.kept_positions_final
        assert (b.evicted_positions, b.eviction_events, b.kv_cache_bytes_peak) == (
            alone.evicted_positions, alone.eviction_events, alone.kv_cache_bytes_peak)
        assert [(r.layer, r.position) for r in b.important_tokens] == [(r.layer, r.position) for r in alone.important_tokens]


def test_a_limit_holding_four_dense_4k_sequences_admits_24_sparse_ones(smollm_engine):
    """The issue's arithmetic on the default model: 4 x (4,000 + 64) dense slots against 513 per streaming request."""
    ids = torch.arange(100, 4100).view(1, -1)
    e = EncodedInput(ids)
    dense = smollm_engine.reserved_kv_bytes(e, build_policy("dense"), 64)
    assert dense == 2 * (4000 + 64 - 1) * 30 * 3 * 64 * 4  # slots x layers x KV heads x head dim x float32, K and V
    batch = smollm_engine.batch(max_batch=256, kv_memory_limit=4 * dense)
    for _ in range(40):
        batch.add(e, build_policy("streaming", 512), GenerationOptions(max_new_tokens=64, tier=0))
    admitted = batch.scheduler.admit()
    assert len(admitted) == 4 * dense // smollm_engine.reserved_kv_bytes(e, build_policy("streaming", 512), 64) >= 24
    for request in list(batch.scheduler.running) + list(batch.scheduler.waiting):
        batch.abort(request.request_id)
    assert batch.reserved_bytes == 0
