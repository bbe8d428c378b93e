"""Long-document protocol: the context is compressed once at step 0; question and answer are never evicted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import KV_HEADS, build_tokenizer, prompt_ids

from sparseety.engine import EncodedInput, encode_document
from sparseety.engine.inputs import encode_with_answer_prefix
from sparseety.errors import InputError
from sparseety.policies import build_policy

CONTEXT, QUESTION, NEW, BUDGET = 40, 8, 8, 12
POLICIES = [
    ("streaming", {}), ("h2o", {}), ("snapkv", {"window": "4"}), ("tova", {}), ("knorm", {}), ("random", {}),
    ("pyramid", {"window": "4", "beta": "4"}), ("kvzip", {"layerwise": "true"}),
    ("kvzip", {"layerwise": "true", "per_head": "false"}),
]
POLICY_IDS = [name + ("-shared" if opts.get("per_head") == "false" else "") for name, opts in POLICIES]


def document() -> EncodedInput:
    ids = torch.cat([prompt_ids(CONTEXT, seed=11), prompt_ids(QUESTION, seed=12)], dim=1)
    return EncodedInput(ids, compress_len=CONTEXT)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
@pytest.mark.parametrize(("name", "opts"), POLICIES, ids=POLICY_IDS)
def test_only_the_context_is_compressed_and_only_at_step_0(name, opts, family, engine_for):
    engine = engine_for(family)
    policy = build_policy(name, BUDGET, opts)
    result = engine.generate(document(), policy, max_new_tokens=NEW, tier=2)
    seen = CONTEXT + QUESTION + NEW - 1
    a = result.arrays
    assert len(result.output_ids) == NEW
    assert set(a["evicted.step"].tolist()) == {0}
    assert a["evicted.position"].max() < CONTEXT
    for layer in range(engine.num_layers):
        budget = policy.layer_budget(layer, engine.num_layers)
        counts = []  # context slots each head kept
        for head in range(KV_HEADS):
            sel = (a["evicted.layer"] == layer) & (a["evicted.kv_head"] == head)
            evicted = a["evicted.position"][sel]
            kept = result.kept_positions_final[str(layer)][str(head)]
            assert set(range(CONTEXT, seen)) <= set(kept), "a question or answer token was evicted"
            assert sorted(set(kept) | set(evicted.tolist())) == list(range(seen))
            counts.append(len(kept) - (seen - CONTEXT))
            assert evicted.size == CONTEXT - counts[-1]
        if policy.splits_heads:  # each head its own count, the layer's memory its budget (layerwise)
            assert sum(counts) == budget * KV_HEADS
        else:
            assert counts == [budget] * KV_HEADS


def test_document_protocol_with_dense_equals_plain_greedy(engine_for, greedy_reference):
    encoded = document()
    result = engine_for("llama").generate(encoded, build_policy("dense"), max_new_tokens=NEW, tier=3)
    assert result.output_ids == greedy_reference("llama", encoded.input_ids, NEW)


def test_budget_covering_the_context_changes_nothing(engine_for):
    engine = engine_for("llama")
    dense = engine.generate(document(), build_policy("dense"), max_new_tokens=NEW, tier=2)
    result = engine.generate(document(), build_policy("h2o", CONTEXT), max_new_tokens=NEW, tier=2)
    assert result.output_ids == dense.output_ids
    assert result.eviction_events == 0


def test_router_probes_cover_every_fed_token_in_document_mode(engine_for):
    result = engine_for("mixtral").generate(document(), build_policy("snapkv", BUDGET, {"window": "4"}),
                                            max_new_tokens=NEW, tier=2)
    for layer in range(3):
        assert result.arrays[f"router.{layer}"].shape == (CONTEXT + QUESTION + NEW - 1, 4)


def test_encode_document_splits_context_and_question():
    tok = build_tokenizer()
    context = " ".join(f"t{i}" for i in range(10, 30))
    encoded = encode_document(tok, context, "t90 t91 t92", chat=False)
    assert encoded.compress_len == 20
    assert encoded.input_ids[0].tolist() == list(range(10, 30)) + [90, 91, 92]


def test_encode_document_with_a_chat_template_cuts_where_the_question_starts():
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}<bos> {{ m['content'] }} <eos>{% endfor %}"
                         "{% if add_generation_prompt %} t150 {% endif %}")
    context = " ".join(f"t{i}" for i in range(10, 20))
    encoded = encode_document(tok, context, "t90 t91", chat=None)  # template on by default
    assert encoded.input_ids[0].tolist() == [1, *range(10, 20), 90, 91, 2, 150]
    assert encoded.compress_len == 11  # <bos> header plus the context


def test_encode_document_rejects_empty_parts():
    tok = build_tokenizer()
    with pytest.raises(InputError):
        encode_document(tok, "  ", "t5", chat=False)
    with pytest.raises(InputError):
        encode_document(tok, "t5 t6", "", chat=False)


def test_document_protocol_evicted_scores_are_finite(engine_for):
    result = engine_for("llama").generate(document(), build_policy("h2o", BUDGET), max_new_tokens=NEW, tier=2)
    assert np.isfinite(result.arrays["evicted.score"]).all()


def test_document_protocol_refuses_speculative_decoding(engine_for):
    """transformers' prompt lookup re-feeds a pre-filled cache on its first step; the engine refuses
    the combination with a clear error rather than silently feeding the context twice."""
    ids = torch.cat([torch.tensor([[11, 23, 37, 41, 53, 67, 79] * 5 + [11, 23, 37, 41, 53]]),
                     prompt_ids(QUESTION, seed=12)], dim=1)
    encoded = EncodedInput(ids, compress_len=CONTEXT)
    with pytest.raises(InputError, match="long-document protocol"):
        engine_for("llama").generate(encoded, build_policy("dense"), max_new_tokens=NEW, tier=2, speculative=3)


def test_an_answer_prefix_follows_the_question_uncompressed():
    tok = build_tokenizer()  # no chat template: a base model's plain text
    encoded = encode_with_answer_prefix(tok, "t10 t11 t12", "t90 t91", "t95 t96", chat=False)
    assert encoded.input_ids[0].tolist() == [10, 11, 12, 90, 91, 95, 96]
    assert encoded.compress_len == 3
    tok.chat_template = ("{% for m in messages %}<bos> {{ m['content'] }} <eos>{% endfor %}"
                         "{% if add_generation_prompt %} t150 {% endif %}")
    chat = encode_with_answer_prefix(tok, "t10 t11", "t90", "t95", chat=None)  # the prefix starts the assistant turn
    assert chat.input_ids[0].tolist() == [1, 10, 11, 90, 2, 150, 95]
    assert chat.compress_len == 3
