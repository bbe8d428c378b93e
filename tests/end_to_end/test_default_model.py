"""The engine on the real default model: the bypass changes nothing, eviction is exact and real."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparseety.engine import encode_document, encode_prompt
from sparseety.models import list_models
from sparseety.models.registry import resolve_model_dir
from sparseety.policies import build_policy

PROMPT = "Write three sentences about a lighthouse keeper who finds a message in a bottle."


def test_default_model_is_listed_and_cached_as_safetensors(smollm):
    assert [m.name for m in list_models()][0] == "smollm2-135m"
    folder = resolve_model_dir("smollm2-135m")
    assert (__import__("pathlib").Path(folder) / "model.safetensors").is_file()
    model, _ = smollm
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3


def test_dense_tier3_equals_plain_generate(smollm, smollm_engine):
    model, tokenizer = smollm
    encoded = encode_prompt(tokenizer, PROMPT, None)
    with torch.inference_mode():
        reference = model.generate(encoded.input_ids, max_new_tokens=32, do_sample=False)
    result = smollm_engine.generate(encoded, build_policy("dense"), max_new_tokens=32, tier=3)
    assert result.output_ids == reference[0, encoded.input_len :].tolist()
    assert result.eviction_events == 0
    assert result.kv_cache_bytes_peak == result.kv_cache_bytes_dense
    assert result.arrays["step_importance"].shape[:2] == (32, 30)


def test_large_budget_equals_dense(smollm_engine):
    tokenizer = smollm_engine.tokenizer
    encoded = encode_prompt(tokenizer, PROMPT, None)
    dense = smollm_engine.generate(encoded, build_policy("dense"), max_new_tokens=16, tier=1)
    for name in ("h2o", "snapkv", "tova", "streaming"):
        sparse = smollm_engine.generate(encoded, build_policy(name, encoded.input_len + 16), max_new_tokens=16, tier=1)
        assert sparse.output_ids == dense.output_ids, name
        assert sparse.eviction_events == 0


def test_streaming_keeps_exactly_sinks_and_recent(smollm_engine):
    encoded = encode_prompt(smollm_engine.tokenizer, PROMPT, None)
    budget, sinks = 24, 4
    result = smollm_engine.generate(encoded, build_policy("streaming", budget), max_new_tokens=12, tier=2)
    seen = encoded.input_len + len(result.output_ids) - 1
    expected = list(range(sinks)) + list(range(seen - (budget - sinks), seen))
    assert result.kept_positions_final is not None
    for layer, heads in result.kept_positions_final.items():
        for head, positions in heads.items():
            assert positions == expected, (layer, head)
    evicted = result.arrays["evicted.position"]
    assert result.evicted_positions == len(np.unique(evicted)) == seen - budget
    assert result.eviction_events == (seen - budget) * 30 * 3
    assert result.kv_cache_bytes_peak == 2 * 30 * 3 * budget * 64 * 4
    assert result.kv_cache_bytes_dense == 2 * 30 * 3 * seen * 64 * 4


def test_budget_holds_and_evicted_plus_kept_is_seen(smollm_engine):
    encoded = encode_prompt(smollm_engine.tokenizer, PROMPT, None)
    budget = 20
    result = smollm_engine.generate(encoded, build_policy("h2o", budget), max_new_tokens=10, tier=2)
    seen = encoded.input_len + len(result.output_ids) - 1
    layers, heads, positions = (result.arrays[f"evicted.{k}"] for k in ("layer", "kv_head", "position"))
    for layer, per_head in result.kept_positions_final.items():
        for head, kept in per_head.items():
            assert len(kept) == budget
            evicted = positions[(layers == int(layer)) & (heads == int(head))]
            assert len(evicted) == len(set(evicted.tolist()))
            assert not set(evicted.tolist()) & set(kept)
            assert len(evicted) + len(kept) == seen


def test_long_document_never_evicts_question_or_answer(smollm_engine):
    context = open("/usr/share/common-licenses/Apache-2.0").read()[:2500]
    encoded = encode_document(smollm_engine.tokenizer, context, "What is this license called?", None)
    assert encoded.compress_len is not None and encoded.compress_len < encoded.input_len
    budget = 64
    result = smollm_engine.generate(encoded, build_policy("snapkv", budget), max_new_tokens=12, tier=2)
    assert result.arrays["evicted.position"].max() < encoded.compress_len
    assert set(result.arrays["evicted.step"].tolist()) == {0}
    seen = encoded.input_len + len(result.output_ids) - 1
    for per_head in result.kept_positions_final.values():
        for kept in per_head.values():
            assert kept[-(seen - encoded.compress_len):] == list(range(encoded.compress_len, seen))
            assert len(kept) == budget + seen - encoded.compress_len


def test_long_document_dense_equals_plain_generate(smollm, smollm_engine):
    model, tokenizer = smollm
    context = open("/usr/share/common-licenses/Apache-2.0").read()[:1500]
    encoded = encode_document(tokenizer, context, "What is this license called?", None)
    with torch.inference_mode():
        reference = model.generate(encoded.input_ids, max_new_tokens=12, do_sample=False)
    result = smollm_engine.generate(encoded, build_policy("dense"), max_new_tokens=12, tier=2)
    assert result.output_ids == reference[0, encoded.input_len :].tolist()


@pytest.mark.parametrize("name", ["snapkv", "pyramid", "knorm", "random", "tova", "topk_attention"])
def test_every_policy_runs_on_the_default_model(smollm_engine, name):
    encoded = encode_prompt(smollm_engine.tokenizer, PROMPT, None)
    result = smollm_engine.generate(encoded, build_policy(name, 32), max_new_tokens=6, tier=2)
    assert len(result.output_ids) == 6
    if name == "topk_attention":
        assert result.eviction_events == 0 and result.skipped_events > 0
        assert result.kv_cache_bytes_peak == result.kv_cache_bytes_dense
    else:
        assert result.eviction_events > 0
        assert result.kv_cache_bytes_peak < result.kv_cache_bytes_dense
