"""The learned head weights shipped for the default model: ``--importance learned`` works with no path."""

from __future__ import annotations

from sparseety.engine import EncodedInput
from sparseety.extract.head_weights import WEIGHTS_DIR, read_head_weights
from sparseety.policies import build_policy

TEXT = "Permission is granted to copy this file. Question: what may you do with the file? Answer:"


def test_shipped_weights_fit_the_default_model_and_rank(smollm_engine):
    engine = smollm_engine
    shipped = read_head_weights(WEIGHTS_DIR / "smollm2-135m.json")
    assert shipped.model_fingerprint == engine.model_info.fingerprint()
    assert tuple(shipped.weights.shape) == (engine.num_layers, engine.num_heads) == (30, 9)
    assert "BSD" in " ".join(shipped.provenance["texts"])  # trained on text bench faithfulness never evaluates
    assert not any(name in " ".join(shipped.provenance["texts"]) for name in ("GPL-3", "Apache", "MPL-2.0"))
    ids = engine.tokenizer(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"]
    result = engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=3, importance="learned")
    assert result.provenance["extraction"]["importance"] == "learned"
    assert result.arrays["sink.position"][0] == 0 and 0 not in {r.position for r in result.important_tokens}
    assert engine.head_weights() is engine.head_weights()  # read once per engine
