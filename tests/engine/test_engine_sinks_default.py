"""Attention sinks on the default model: the first position is one whether or not it is a special token."""

from __future__ import annotations

import pytest
import torch

from sparseety.engine import EncodedInput
from sparseety.policies import build_policy

TEXT = ("The licensee may copy and distribute the program in object code form, provided that the source "
        "code is also made available under the same terms. Question: what must come with object code? Answer:")


@pytest.mark.parametrize("mode", ["value", "output"])
def test_first_position_is_a_sink_and_leaves_the_ranking(smollm_engine, mode):
    engine = smollm_engine
    ids = engine.tokenizer(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert int(ids[0, 0]) not in engine.tokenizer.all_special_ids  # a plain word: still a sink
    attention = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=4, importance="attention")
    scored = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=4, importance=mode)
    assert scored.output_ids == attention.output_ids
    overall = [r for r in attention.important_tokens if r.layer is None]
    assert overall[0].position == 0  # the raw attention ranking is topped by the sink
    sinks = scored.arrays["sink.position"].tolist()
    assert sinks[0] == 0 and all(0 <= p < ids.shape[1] for p in sinks)
    assert 0 not in {r.position for r in scored.important_tokens}
    totals = torch.from_numpy(attention.arrays["importance"].astype("float32")).sum(0)
    assert float(totals[0] / totals.sum()) > 0.3  # it takes a large share of all attention
