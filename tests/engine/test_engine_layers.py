"""Layer selection for online extraction: a list records only those layers (and computes rows only there),
``auto`` picks the layer with the highest top-k mass of the last prompt row, bad layer lists are errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_model, prompt_ids, run

import sparseety.engine.attention as attention
from sparseety.engine.layers import parse_layers, topk_mass
from sparseety.errors import ConfigError
from sparseety.policies import build_policy

PROMPT, NEW = 24, 5


@pytest.fixture
def row_prob_calls(monkeypatch):
    """Count the hook point's attention-row computations (the real function still runs)."""
    calls = []
    real = attention.row_probs

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "row_probs", counting)
    return calls


def test_listed_layers_record_alone_and_cost_less(engine_for, row_prob_calls):
    engine, ids = engine_for("llama"), prompt_ids(PROMPT)
    everything = run(engine, ids, build_policy("dense"), NEW, tier=2)
    all_calls = len(row_prob_calls)
    row_prob_calls.clear()
    listed = run(engine, ids, build_policy("dense"), NEW, tier=2, layers="2,0")
    assert all_calls == 4 * NEW and len(row_prob_calls) == 2 * NEW  # one row per recording layer and forward
    assert listed.output_ids == everything.output_ids
    imp, ref = listed.arrays["importance"], everything.arrays["importance"]
    np.testing.assert_array_equal(imp[[0, 2]], ref[[0, 2]])
    assert not imp[[1, 3]].any() and ref[[1, 3]].all(axis=1).any()
    assert {r.layer for r in listed.important_tokens} == {None, 0, 2}
    assert listed.extraction_layers == [0, 2] and listed.to_json()["extraction"] == {"layers": "0,2", "recorded_layers": [0, 2]}
    assert listed.provenance["extraction"]["recorded_layers"] == [0, 2]
    assert everything.extraction_layers == [0, 1, 2, 3] and everything.layer_selection == "all"


def _independent_masses(family: str, ids: torch.Tensor, k: int) -> list[float]:
    """Top-k mass of the last prompt row per layer, from an eager twin's attention weights."""
    model = build_model(family)
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = model(ids, output_attentions=True).attentions
    return [float(a[0, :, -1].mean(dim=0).topk(k).values.sum()) for a in attentions]


@pytest.mark.parametrize("family,seed,k", [("llama", 1, 2), ("llama", 4, 4), ("qwen2", 2, 3), ("qwen2_moe", 3, 2)])
def test_auto_picks_the_layer_with_the_highest_topk_mass(family, seed, k, engine_for, row_prob_calls):
    engine, ids = engine_for(family), prompt_ids(PROMPT, seed=seed)
    masses = _independent_masses(family, ids, k)
    expected = int(np.argmax(masses))
    everything = run(engine, ids, build_policy("dense"), NEW, tier=2, top_k=k)
    row_prob_calls.clear()
    auto = run(engine, ids, build_policy("dense"), NEW, tier=2, top_k=k, layers="auto")
    assert auto.extraction_layers == [expected], masses
    assert auto.provenance["extraction"]["layers"] == "auto"
    assert len(row_prob_calls) == engine.num_layers + (NEW - 1)  # every layer in prefill, then the chosen one
    others = [layer for layer in range(engine.num_layers) if layer != expected]
    assert not auto.arrays["importance"][others].any()
    np.testing.assert_array_equal(auto.arrays["importance"][expected], everything.arrays["importance"][expected])
    assert {r.layer for r in auto.important_tokens} == {None, expected}


def test_auto_choices_differ_between_requests():
    """The choice is per request: the four cases above do not all pick one layer (else the test proves little)."""
    picks = {int(np.argmax(_independent_masses(f, prompt_ids(PROMPT, seed=s), k)))
             for f, s, k in [("llama", 1, 2), ("llama", 4, 4), ("qwen2", 2, 3), ("qwen2_moe", 3, 2)]}
    assert len(picks) > 1


def test_topk_mass_is_the_head_mean_of_the_largest_entries():
    row = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [b, heads, n]
    assert topk_mass(row, 1) == pytest.approx(0.5)  # head mean [0.3, 0.2, 0.5]
    assert topk_mass(row, 2) == pytest.approx(0.8)
    assert topk_mass(row, 9) == pytest.approx(1.0)


def test_below_tier_two_nothing_records(engine_for):
    result = run(engine_for("llama"), prompt_ids(PROMPT), build_policy("dense"), 2, tier=1, layers="auto")
    assert result.extraction_layers is None and "importance" not in result.arrays


@pytest.mark.parametrize("spec,message", [
    ("4", r"layer 4 is outside the model's layers 0\.\.3"), ("1,1", "listed twice"), ("-1", "negative"),
    ("1,x", "'x' is not a layer number"), ("", "'' is not a layer number"), ([0.5], "0.5 is not a layer number"),
])
def test_bad_layer_lists(spec, message, engine_for):
    with pytest.raises(ConfigError, match=message):
        parse_layers(spec, 4)
    with pytest.raises(ConfigError, match=message):
        run(engine_for("llama"), prompt_ids(4), build_policy("dense"), 1, layers=spec)


def test_layer_specs_parse():
    assert parse_layers("ALL").mode == "all" and parse_layers(None).text() == "all"
    assert parse_layers(" auto ").text() == "auto"
    assert parse_layers("29, 0,15").layers == (0, 15, 29) and parse_layers([3, 1]).text() == "1,3"
