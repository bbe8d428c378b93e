"""``--importance attention|value|output`` at the hook point, against an independent eager computation.

The reference is a never-wrapped build of the same tiny model run once over the whole sequence with
eager attention (``output_attentions``): the rows that produced the output tokens give α, the values
come from each layer's own ``v_proj`` on its input, and ``W_O^h`` is a slice of ``o_proj``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_model, prompt_ids

from sparseety.engine import EncodedInput
from sparseety.engine.batch import BatchEngine
from sparseety.engine.cache import SparseLayer
from sparseety.engine.request import GenerationOptions
from sparseety.errors import InputError
from sparseety.extract.scoring import find_sinks, slot_norms
from sparseety.policies import build_policy

NEW = 6


def reference_importance(family: str, sequence: list[int], prompt_len: int, mode: str) -> np.ndarray:
    """``[layers, seen]``: Σ over the emitting rows of the mean over query heads of α·(1, ‖v‖ or ‖W_O^h v‖)."""
    model = build_model(family)
    model.set_attn_implementation("eager")
    ids = torch.tensor([sequence[:-1]])  # the last token is never fed back
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    seen = ids.shape[1]
    rows = range(prompt_len - 1, seen)
    total = np.zeros((cfg.num_hidden_layers, seen))
    for layer, block in enumerate(model.model.layers):
        att = out.attentions[layer][0].double()  # [heads, T, T]
        with torch.no_grad():
            v = block.self_attn.v_proj(block.input_layernorm(out.hidden_states[layer]))[0]  # [T, kv*d]
        v = v.double().reshape(seen, kv_heads, d)
        w = block.self_attn.o_proj.weight.detach().double()  # [hidden, heads*d]
        for h in range(heads):
            vh = v[:, h // (heads // kv_heads)]  # [T, d]
            if mode == "attention":
                norm = torch.ones(seen, dtype=torch.float64)
            elif mode == "value":
                norm = vh.norm(dim=-1)
            else:
                norm = (vh @ w[:, h * d : (h + 1) * d].T).norm(dim=-1)
            for r in rows:
                total[layer] += (att[h, r] * norm).numpy() / heads
    return total


@pytest.mark.parametrize("mode", ["attention", "value", "output"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mode_scores_equal_the_eager_reference(engine_for, family, mode):
    engine = engine_for(family)
    ids = prompt_ids(20, seed=4)
    result = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=NEW, tier=2, importance=mode)
    expected = reference_importance(family, result.prompt_ids + result.output_ids, 20, mode)
    got = result.arrays["importance"].astype(np.float64)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-4)  # float16 storage
    assert ("sink.position" in result.arrays) == (mode != "attention")


@pytest.mark.parametrize("mode", ["value", "output"])
def test_mode_keeps_the_dense_tokens_and_follows_eviction(engine_for, mode):
    """Importance is observation only; under eviction the norms move with their slots (h2o, small budget)."""
    engine = engine_for("llama")
    ids = prompt_ids(40, seed=8)
    plain = engine.generate(EncodedInput(ids), build_policy("h2o", 12), max_new_tokens=NEW, importance="attention")
    scored = engine.generate(EncodedInput(ids), build_policy("h2o", 12), max_new_tokens=NEW, importance=mode)
    assert scored.output_ids == plain.output_ids
    np.testing.assert_array_equal(scored.arrays["evicted.position"], plain.arrays["evicted.position"])
    cache_free = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=NEW, importance=mode)
    dense = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=NEW, importance="attention")
    assert cache_free.output_ids == dense.output_ids


def test_mode_trace_equal_alone_and_in_a_batch(engine_for):
    engine = engine_for("llama")
    encoded = [EncodedInput(prompt_ids(n, seed=n)) for n in (9, 30, 17)]
    alone = [engine.generate(e, build_policy("h2o", 10), max_new_tokens=NEW, importance="output") for e in encoded]
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=8)
    for i, e in enumerate(encoded):
        batch.add(e, build_policy("h2o", 10), GenerationOptions(max_new_tokens=NEW, importance="output"),
                  request_id=str(i))
    results = batch.run()
    for i, single in enumerate(alone):
        together = results[str(i)]
        assert together.output_ids == single.output_ids
        np.testing.assert_array_equal(together.arrays["sink.position"], single.arrays["sink.position"])
        np.testing.assert_allclose(together.arrays["importance"].astype(np.float32),
                                   single.arrays["importance"].astype(np.float32), rtol=2e-3, atol=1e-4)
        assert [(r.position, r.layer) for r in together.important_tokens] == \
            [(r.position, r.layer) for r in single.important_tokens]


@pytest.mark.parametrize("evicted", [1, 3, 40])  # the decode step, a small in-place eviction, a reallocation
def test_norms_follow_their_slots_through_eviction_and_splits(evicted):
    layer = SparseLayer()
    layer.norm_fn = lambda v: slot_norms(v, "value")
    torch.manual_seed(0)
    layer.update(torch.randn(1, 2, 60, 4), torch.randn(1, 2, 60, 4))
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    slots = torch.stack([torch.randperm(61)[:evicted] for _ in range(2)]).unsqueeze(0)
    layer.evict(slots)
    torch.testing.assert_close(layer.norms, layer.values.norm(dim=-1, keepdim=True))
    layer.expire()
    layer.split([torch.arange(0, 10), torch.arange(5, 20)], [10, 15])
    regions = layer.regions
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    regions.evict_over_budget(torch.rand(regions.pos.shape[-1]))
    for head in range(2):
        live = regions.live(head)
        torch.testing.assert_close(regions.norm[0, 0, live], regions.v[0, 0, live].norm(dim=-1, keepdim=True))


def test_attention_mode_is_todays_trace(engine_for):
    """The Python door defaults to ``value``, as the command line does (issue 38: it used to default to
    ``attention``); ``attention`` asked for explicitly is the trace it always was."""
    engine = engine_for("llama")
    ids = prompt_ids(25, seed=3)
    default = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=NEW)
    value = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=NEW, importance="value")
    explicit = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=NEW, importance="attention")
    np.testing.assert_array_equal(default.arrays["importance"], value.arrays["importance"])
    assert default.provenance["extraction"]["importance"] == "value"
    assert "sink.position" not in explicit.arrays and "importance" not in explicit.provenance["extraction"]


def test_sinks_are_marked_and_left_out_of_the_rankings(engine_for):
    engine = engine_for("llama")
    result = engine.generate(EncodedInput(prompt_ids(30, seed=2)), build_policy("dense"), max_new_tokens=NEW,
                             importance="value")
    sinks = result.arrays["sink.position"].tolist()
    assert sinks[0] == 0
    assert not {r.position for r in result.important_tokens} & set(sinks)
    assert result.provenance["extraction"]["importance"] == "value"


def test_bad_mode_is_refused():
    with pytest.raises(InputError, match="importance must be one of attention, value, output, learned, got 'grad'"):
        GenerationOptions(importance="grad")


def test_sink_rule():
    attention = torch.tensor([[5.0, 1.0, 3.0, 1.0]])
    # position 2 takes 30% of the attention with a norm of 0.1 against a median of 1: a sink; 0 always is
    scores = attention * torch.tensor([1.0, 1.0, 0.1, 1.0])
    assert find_sinks(attention, scores) == [0, 2]
    assert find_sinks(attention, attention) == [0]
    assert find_sinks(attention, None) == [0]
