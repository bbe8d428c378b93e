"""``kvzap`` in the engine: a chunked prefill keeps the same sets as one prefill, a batch (packed forwards,
mixed with other policies) gives each request what it gets alone, on the plain and the hybrid tiny model,
in ratio and threshold modes; the hidden states are captured only for a policy that reads them."""

from __future__ import annotations

import pytest
import torch
from test_engine_batch import NEW, assert_same_trace, inputs
from tiny_models import prompt_ids

from sparseety.engine import EncodedInput
from sparseety.engine.request import GenerationOptions
from sparseety.fingerprint import model_fingerprint
from sparseety.policies import build_policy
from sparseety.policies.parts.kvzap_model import Surrogate


def surrogate_file(engine, tmp_path_factory, seed: int = 0):
    model = engine.model
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    s = Surrogate(w1=torch.zeros(layers, hidden, 0), b1=torch.zeros(layers, 0),
                  w2=torch.randn(layers, hidden, 2, generator=g) / 8, b2=torch.randn(layers, 2, generator=g),
                  model=engine.model_name, model_fingerprint=model_fingerprint(model))
    return s.save(tmp_path_factory.mktemp("kvzap") / f"{engine.model_name}.safetensors")


@pytest.fixture(scope="module")
def files(engine_for, tmp_path_factory):
    return {family: surrogate_file(engine_for(family), tmp_path_factory) for family in ("llama", "gemma3")}


def kvzap_policies(path):
    return [
        build_policy("kvzap", 21, {"model": str(path), "window": "4"}),  # a layer's heads share its budget
        build_policy("kvzap", None, {"model": str(path), "threshold": "0.0", "window": "6"}),
        build_policy("kvzap", None, {"model": str(path), "threshold": "-0.2", "max_kept": "18"}),
        build_policy("kvzap", 21, {"model": str(path), "window": "4", "share": "true"}),  # every layer's heads share
        build_policy("kvzap", 21, {"model": str(path), "window": "4", "per_head": "false"}),  # uniform counts
        build_policy("kvzap", 21, {"model": str(path), "window": "4", "per_head": "false", "share": "true"}),
    ]


@pytest.mark.parametrize("chunk", [7, 32])
@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5])
def test_chunked_prefill_keeps_the_same_sets_as_one_prefill(engine_for, files, chunk, mode):
    engine = engine_for("llama")
    e, policy = EncodedInput(prompt_ids(100, seed=9)), kvzap_policies(files["llama"])[mode]
    alone = engine.generate(e, policy, max_new_tokens=NEW, tier=3)
    (chunked,) = engine.generate_batch([e], policy, GenerationOptions(max_new_tokens=NEW, tier=3), prefill_chunk=chunk)
    assert_same_trace(alone, chunked)
    assert (alone.arrays["evicted.step"] == 0).any() and (alone.arrays["evicted.step"] > 0).any()
    assert ("kept_fraction" in alone.arrays) == (mode in (1, 2))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kvzap_in_a_mixed_batch_equals_each_alone(engine_for, files, family):
    engine = engine_for(family)
    pols = [*kvzap_policies(files[family]), build_policy("tova", 18), build_policy("dense"), build_policy("h2o", 24)]
    encoded = inputs([90, 40, 63, 71, 84, 66, 77, 17, 50])
    options = GenerationOptions(max_new_tokens=NEW, tier=3)
    batched = engine.generate_batch(encoded, pols, options, prefill_chunk=4096 if family == "gemma3" else 24)
    for e, p, b in zip(encoded, pols, batched):
        assert_same_trace(engine.generate(e, p, max_new_tokens=NEW, tier=3), b)
    assert all(b.eviction_events for b in batched[:6])


def test_hidden_states_reach_only_a_policy_that_reads_them(engine_for, files):
    engine = engine_for("llama")
    seen: list[tuple[bool, int]] = []
    for policy in (build_policy("tova", 18), kvzap_policies(files["llama"])[0]):
        with engine.open_run(EncodedInput(prompt_ids(30, seed=2)), policy, tier=0) as ctx:
            engine.model(input_ids=prompt_ids(30, seed=2), past_key_values=ctx.cache, use_cache=True)
            seen.append((ctx.wants_hidden, len(ctx.forward.hidden) + len(ctx.carry.hidden)))
    assert seen == [(False, 0), (True, 0)]  # kvzap's were handed over and dropped, layer by layer


def test_per_head_counts_refuse_attention_topk_and_run_with_speculation_and_pruning(engine_for, files):
    """Per-head layers can neither rank one shared top-k nor take rejected drafts back (typed refusals naming
    the way out, per_head=false, which then composes with both); prompt pruning composes."""
    from sparseety.prune_schedule import parse_prune_schedule
    from sparseety.errors import ConfigError, InputError

    engine = engine_for("llama")
    path = str(files["llama"])
    e = EncodedInput(prompt_ids(60, seed=5))
    with pytest.raises(InputError, match="kvzap.*each KV head.*per_head=false"):
        engine.generate(e, build_policy("kvzap", 20, {"model": path}), max_new_tokens=3, attention_topk=4)
    uniform = engine.generate(e, build_policy("kvzap", 20, {"model": path, "per_head": "false"}), max_new_tokens=3,
                              attention_topk=4, tier=1)
    assert uniform.skipped_events > 0
    with pytest.raises(ConfigError, match="kvzap.*each KV head.*rejected drafts.*per_head=false"):
        engine.generate(e, build_policy("kvzap", 20, {"model": path}), max_new_tokens=6, speculative=2)
    options = {"model": path, "per_head": "false"}
    drafted = engine.generate(e, build_policy("kvzap", 20, options), max_new_tokens=6, tier=1, speculative=2)
    assert len(drafted.token_ids) == 60 + 6 and drafted.eviction_events
    pruned = engine.generate(e, build_policy("kvzap", 20, {"model": path}), max_new_tokens=3, tier=1,
                             prune=parse_prune_schedule("1:0.3"))
    assert len(pruned.token_ids) == 60 + 3 and pruned.eviction_events
