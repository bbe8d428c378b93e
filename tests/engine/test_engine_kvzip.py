"""``kvzip`` through the engine: the reconstruction pass scores, leaves no trace, and runs the same in every path.

The kept sets are checked against a straightforward reimplementation that shares no code with the
engine: a never-wrapped copy of the model in eager attention, its full attention probabilities of the
repeat pass (renormalised over kvpress's key subset), the max over rows and head group, sinks kept,
top budget per head (ties to the lower position).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine_batch import assert_same_trace
from tiny_models import KV_HEADS, build_model, prompt_ids
from transformers import DynamicCache

from sparseety.analysis.fidelity import teacher_forced_logprobs
from sparseety.engine import EncodedInput
from sparseety.engine.request import GenerationOptions
from sparseety.errors import ConfigError, InputError, SparseetyError
from sparseety.policies import build_policy
from sparseety.policies.kvzip import PREVIOUS_TAIL, REPEAT_PART_PROMPT, REPEAT_PROMPT
from sparseety.prune_schedule import parse_prune_schedule

NEW = 8


@pytest.fixture(scope="module")
def eager_model():
    model = build_model("llama")
    model.set_attn_implementation("eager")
    return model


def reference_budgets(scores: torch.Tensor, budget: int) -> list[int]:
    """Per layer, its share of ``layers x budget`` slots per head: one each, then one at a time to the layer
    whose next slot adds most (its heads' next-best scores summed)."""
    best = scores.sort(dim=-1, descending=True).values.sum(dim=1).tolist()  # [layers][n]
    shares = [1] * len(best)
    for _ in range(len(best) * (budget - 1)):
        gains = [row[k] if k < len(row) else float("-inf") for row, k in zip(best, shares)]
        shares[gains.index(max(gains))] += 1
    return shares


def reference_head_counts(scores: torch.Tensor, budget: int, layers: list[int]) -> dict[int, list[int]]:
    """Per layer of ``layers``, per KV head: how many of the best ``len(layers) x heads x budget`` slots over
    all of them it holds, each head's best slot (the first of its maxima) first, then ties to the lower
    layer, head, position."""
    n = scores.shape[-1]
    cells = []
    for layer in layers:
        for head in range(KV_HEADS):
            row = [float(scores[layer, head, p]) for p in range(n)]
            best = row.index(max(row))
            cells += [(0 if p == best else 1, -row[p], layer, head, p) for p in range(n)]
    won = sorted(cells)[: len(layers) * KV_HEADS * budget]
    return {layer: [sum(1 for c in won if c[2] == layer and c[3] == head) for head in range(KV_HEADS)]
            for layer in layers}


def reference_kept(model, tokenizer, context: list[int], budget: int, sinks: int = 4,
                   chunk_size: int = 2048, layerwise: bool = False,
                   per_head: bool = True, attend_chunk: bool = False) -> dict[int, list[list[int]]]:
    """Per layer, per KV head: the positions KVzip keeps, computed from eager attention on a DynamicCache
    (``attend_chunk``: a 4D mask hides every context key outside the scoring set from the repeat rows)."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    suffix = enc("\n")  # no chat template
    n = len(context)
    layers = model.config.num_hidden_layers
    scores = torch.zeros(layers, KV_HEADS, n)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
        pieces = [context[i : i + chunk_size] for i in range(0, n, chunk_size)]
        start = 0
        for i, piece in enumerate(pieces):
            prompt = enc(REPEAT_PROMPT) if i == 0 else enc(REPEAT_PART_PROMPT) + pieces[i - 1][-PREVIOUS_TAIL:]
            ids = prompt + suffix + piece
            q = len(ids)
            sink = min(sinks, start)
            cols = list(range(sink)) + list(range(start, start + len(piece))) + list(range(n, n + q))
            mask = None
            if attend_chunk:
                seen = torch.zeros(q, n + q, dtype=torch.bool)
                seen[:, cols[: len(cols) - q]] = True
                seen[:, n:] = torch.ones(q, q, dtype=torch.bool).tril()
                mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None]
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, output_attentions=True,
                        attention_mask=mask)
            for layer, att in enumerate(out.attentions):  # [1, heads, q, n + q], softmax over every key
                sub = att[0][..., cols]
                sub = sub / sub.sum(dim=-1, keepdim=True)  # kvpress's softmax over the subset only
                part = sub[..., sink : sink + len(piece)]  # [heads, q, len]
                part = part.reshape(KV_HEADS, -1, q, len(piece)).amax(dim=(1, 2))
                scores[layer, :, start : start + len(piece)] = part
            cache.crop(-q)
            start += len(piece)
    scores[..., :sinks] = float("inf")
    if per_head:
        groups = [[layer] for layer in range(layers)] if layerwise else [list(range(layers))]
        counts = {layer: c for group in groups for layer, c in reference_head_counts(scores, budget, group).items()}
    else:
        shares = [budget] * layers if layerwise else reference_budgets(scores, budget)
        counts = {layer: [shares[layer]] * KV_HEADS for layer in range(layers)}
    kept = {}
    for layer in range(layers):
        kept[layer] = []
        for head in range(KV_HEADS):
            order = sorted(range(n), key=lambda p: (-float(scores[layer, head, p]), p))
            kept[layer].append(sorted(order[: counts[layer][head]]))
    return kept


def kept_of(result, layer: int, head: int) -> list[int]:
    return result.kept_positions_final[str(layer)][str(head)]


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("n, budget, chunk_size", [(60, 20, 2048), (75, 30, 16), (41, 9, 41)])
def test_kept_sets_equal_an_eager_reimplementation(n, budget, chunk_size, layerwise, per_head, engine_for, tokenizer,
                                                   eager_model):
    engine = engine_for("llama")
    ids = prompt_ids(n, seed=n)
    policy = build_policy("kvzip", budget, {"chunk_size": str(chunk_size), "layerwise": str(layerwise),
                                            "per_head": str(per_head)})
    result = engine.generate(EncodedInput(ids), policy, max_new_tokens=1, tier=2)
    expected = reference_kept(eager_model, tokenizer, ids[0].tolist(), budget, chunk_size=chunk_size,
                              layerwise=layerwise, per_head=per_head)
    counts = [len(heads) for layer in range(engine.num_layers) for heads in expected[layer]]
    assert sum(counts) == engine.num_layers * KV_HEADS * budget  # the same memory whatever the split
    if per_head:  # heads differ, and the cache holds exactly the kept slots
        assert len(set(counts)) > 1
        assert result.kv_cache_bytes_peak == sum(counts) * 2 * engine.head_dim * 4
    elif not layerwise:  # the shares differ between layers
        assert len(set(counts)) > 1
    for layer in range(engine.num_layers):
        for head in range(KV_HEADS):
            assert kept_of(result, layer, head) == expected[layer][head], (layer, head)
    a = result.arrays
    assert set(a["evicted.step"].tolist()) == {0}
    assert a["evicted.position"].size == engine.num_layers * KV_HEADS * (n - budget)
    assert torch.isfinite(torch.from_numpy(a["evicted.score"].astype("float64"))).all()


@pytest.mark.parametrize("n, budget, chunk_size", [(60, 20, 2048), (75, 30, 16), (41, 9, 41)])
def test_attend_chunk_keeps_what_a_pass_masked_to_the_scoring_set_keeps(n, budget, chunk_size, engine_for, tokenizer,
                                                                       eager_model):
    """``attend="chunk"``: the repeat rows see only the sinks, their chunk and themselves."""
    engine = engine_for("llama")
    ids = prompt_ids(n, seed=n + 1)
    options = {"chunk_size": str(chunk_size), "attend": "chunk"}
    result = engine.generate(EncodedInput(ids), build_policy("kvzip", budget, options), max_new_tokens=1, tier=2)
    expected = reference_kept(eager_model, tokenizer, ids[0].tolist(), budget, chunk_size=chunk_size,
                              attend_chunk=True)
    for layer in range(engine.num_layers):
        for head in range(KV_HEADS):
            assert kept_of(result, layer, head) == expected[layer][head], (layer, head)
    if chunk_size < n:  # several chunks: hiding the rest of the context changes what the pass keeps
        full = reference_kept(eager_model, tokenizer, ids[0].tolist(), budget, chunk_size=chunk_size)
        assert full != expected


def test_the_reconstruction_leaves_no_trace(engine_for, greedy_reference):
    """A budget that never evicts: the pass ran, yet the tokens are plain greedy generation's."""
    engine = engine_for("llama")
    ids = prompt_ids(50, seed=5)
    result = engine.generate(EncodedInput(ids), build_policy("kvzip", 50 + NEW), max_new_tokens=NEW, tier=2)
    assert result.output_ids == greedy_reference("llama", ids, NEW)
    assert result.eviction_events == 0
    assert result.prefill_s > 0
    assert result.kv_cache_bytes_peak == result.kv_cache_bytes_dense  # the repeat pass's KV is never counted


@pytest.mark.parametrize("per_head", [False, True])
def test_cache_after_the_pass_holds_only_kept_context_slots(per_head, engine_for):
    engine = engine_for("llama")
    n, budget = 64, 24
    encoded = EncodedInput(prompt_ids(n, seed=8))
    policy = build_policy("kvzip", budget, {"layerwise": "true", "per_head": str(per_head)})
    with engine.open_run(encoded, policy, tier=1) as ctx:
        engine.model(input_ids=encoded.input_ids, past_key_values=ctx.cache, use_cache=True)
        assert ctx.reconstruction.pending and not len(ctx.evictions)
        assert ctx.cache.layers[0].num_slots() == n  # eviction deferred to after the pass
        engine.reconstruct(ctx, encoded)
        assert not ctx.reconstruction.pending
        per_slot = 2 * engine.head_dim * 4  # one KV head's key and value
        for layer in ctx.cache.layers:
            assert layer.seen == n and layer.get_seq_length() == n
            assert (layer.regions is not None) == per_head
            counts = [int(p.numel()) for p in layer.head_slots()]
            assert sum(counts) == budget * KV_HEADS  # layerwise: the layer's memory is its budget, split or not
            assert (len(set(counts)) > 1) == per_head
            assert int(layer.positions.max()) < n
            assert layer.nbytes() == budget * KV_HEADS * per_slot
            assert layer.allocated_bytes() < n * KV_HEADS * per_slot  # the buffers shrank with the eviction
        assert ctx.peak_bytes == engine.num_layers * budget * KV_HEADS * per_slot
        out = engine.model(input_ids=torch.tensor([[7]]), past_key_values=ctx.cache, use_cache=True)
        assert out.logits.shape[1] == 1
        for layer in ctx.cache.layers:  # the next token sits at position n in every head, as if no pass had run
            assert layer.seen == n + 1
            assert all(int(p.max()) == n and int((p == n).sum()) == 1 for p in layer.head_slots())


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("layerwise", [True, False])
def test_budget_holds_every_decode_step_and_the_window_is_kept(layerwise, per_head, engine_for):
    """Each head's count (uniform, its layer's share, or its own) holds at every decode step."""
    engine = engine_for("llama")
    n, budget, window = 40, 16, 4
    policy = build_policy("kvzip", budget, {"window": str(window), "layerwise": str(layerwise),
                                            "per_head": str(per_head)})
    result = engine.generate(EncodedInput(prompt_ids(n, seed=2)), policy, max_new_tokens=12, tier=2)
    a = result.arrays
    shares = {(layer, head): len(kept_of(result, layer, head))
              for layer in range(engine.num_layers) for head in range(KV_HEADS)}
    assert sum(shares.values()) == engine.num_layers * KV_HEADS * budget
    assert (len(set(shares.values())) == 1) == (layerwise and not per_head)
    if not per_head:
        assert all(shares[layer, head] == shares[layer, 0] for layer, head in shares)
    assert result.kv_cache_bytes_peak == sum(shares.values()) * 2 * engine.head_dim * 4  # held after each step
    for (layer, head), share in shares.items():
        sel = (a["evicted.layer"] == layer) & (a["evicted.kv_head"] == head)
        steps, positions = a["evicted.step"][sel], a["evicted.position"][sel]
        assert (steps == 0).sum() == n - share
        for step in range(1, 12):  # one new slot per step, one evicted: the count holds
            at = positions[steps == step]
            assert at.size == 1
            assert at[0] <= n + step - 1 - window, "a protected recent slot was evicted"
            assert at[0] >= 4, "a sink was evicted"


def test_long_document_compresses_the_context_only(engine_for, tokenizer, eager_model):
    engine = engine_for("llama")
    context, question, budget = 48, 9, 14
    ids = torch.cat([prompt_ids(context, seed=21), prompt_ids(question, seed=22)], dim=1)
    encoded = EncodedInput(ids, compress_len=context)
    policy = build_policy("kvzip", budget)
    result = engine.generate(encoded, policy, max_new_tokens=NEW, tier=2)
    expected = reference_kept(eager_model, tokenizer, ids[0, :context].tolist(), budget)
    seen = context + question + NEW - 1
    assert set(result.arrays["evicted.step"].tolist()) == {0}
    for layer in range(engine.num_layers):
        for head in range(KV_HEADS):
            kept = kept_of(result, layer, head)
            assert kept == expected[layer][head] + list(range(context, seen))
    (batched,) = engine.generate_batch([encoded], policy, GenerationOptions(max_new_tokens=NEW, tier=2), prefill_chunk=5)
    assert_same_trace(result, batched)


def test_a_budget_covering_the_context_skips_the_pass_in_the_document_protocol(engine_for):
    engine = engine_for("llama")
    ids = torch.cat([prompt_ids(30, seed=1), prompt_ids(6, seed=2)], dim=1)
    encoded = EncodedInput(ids, compress_len=30)
    with engine.open_run(encoded, build_policy("kvzip", 30), tier=1) as ctx:
        engine.model(input_ids=ids[:, :30], past_key_values=ctx.cache, use_cache=True)
        assert not ctx.reconstruction.pending


@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_prefill_equals_one_prefill(chunk, engine_for):
    engine = engine_for("llama")
    e, policy = EncodedInput(prompt_ids(100, seed=9)), build_policy("kvzip", 30, {"chunk_size": "40"})
    alone = engine.generate(e, policy, max_new_tokens=NEW, tier=3)
    (chunked,) = engine.generate_batch([e], policy, GenerationOptions(max_new_tokens=NEW, tier=3), prefill_chunk=chunk)
    assert_same_trace(alone, chunked)
    assert (alone.arrays["evicted.step"] == 0).any()


def test_in_a_batch_of_other_policies_kvzip_sees_what_it_sees_alone(engine_for):
    engine = engine_for("llama")
    inputs = [EncodedInput(prompt_ids(n, seed=n)) for n in (45, 12, 70, 33)]
    policies = [build_policy("kvzip", 20), build_policy("h2o", 16), build_policy("kvzip", 25, {"window": "0"}),
                build_policy("streaming", 10)]
    options = GenerationOptions(max_new_tokens=NEW, tier=2)
    batched = engine.generate_batch(inputs, policies, options, prefill_chunk=16, max_batch=4)
    for e, p, b in zip(inputs, policies, batched):
        assert_same_trace(engine.generate(e, p, max_new_tokens=NEW, tier=2), b)


def test_a_first_token_that_ends_the_answer_and_a_one_token_answer(engine_for):
    engine = engine_for("llama")
    e = EncodedInput(prompt_ids(30, seed=3))
    one = engine.generate(e, build_policy("kvzip", 10), max_new_tokens=1, tier=1)
    (batched,) = engine.generate_batch([e], build_policy("kvzip", 10), GenerationOptions(max_new_tokens=1, tier=1))
    assert len(one.output_ids) == 1 and batched.output_ids == one.output_ids
    assert one.eviction_events == batched.eviction_events == engine.num_layers * KV_HEADS * 20


def test_the_streamer_sees_the_prompt_once_then_every_token(engine_for):
    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    engine = engine_for("llama")
    e = EncodedInput(prompt_ids(30, seed=4))
    streamer = Collect()
    result = engine.generate(e, build_policy("kvzip", 10), max_new_tokens=5, tier=1, streamer=streamer)
    assert streamer.puts[0] == e.input_ids[0].tolist()
    assert sum(streamer.puts[1:], []) == result.output_ids and streamer.ended


def test_teacher_forcing_runs_the_pass_too(engine_for):
    engine = engine_for("llama")
    e = EncodedInput(prompt_ids(40, seed=6))
    policy = build_policy("kvzip", 12)
    result = engine.generate(e, policy, max_new_tokens=4, tier=1)
    forced = teacher_forced_logprobs(engine, e, policy, result.output_ids)
    assert forced.argmax(dim=-1).tolist() == result.output_ids


def test_what_kvzip_cannot_run_with_is_refused_by_name(engine_for):
    engine = engine_for("llama")
    e = EncodedInput(prompt_ids(30, seed=4))
    with pytest.raises(ConfigError, match="kvzip.*speculative"):
        engine.generate(e, build_policy("kvzip", 10), max_new_tokens=3, speculative=2)
    with pytest.raises(ConfigError, match="kvzip.*pruning"):
        engine.generate(e, build_policy("kvzip", 10), max_new_tokens=3, prune=parse_prune_schedule("1:0.5"))
    with pytest.raises(SparseetyError, match="kvzip.*pruning"):
        engine.batch().add(e, build_policy("kvzip", 10), GenerationOptions(prune=parse_prune_schedule("1:0.5")))
    with pytest.raises(InputError, match="kvzip.*each KV head.*per_head=false"):  # per-head counts: no shared top-k
        engine.generate(e, build_policy("kvzip", 10), max_new_tokens=3, attention_topk=4)
    with pytest.raises(InputError, match="per_head=false"):
        engine.batch().add(e, build_policy("kvzip", 10), GenerationOptions(attention_topk=4))
    shared = engine.generate(e, build_policy("kvzip", 10, {"per_head": "false"}), max_new_tokens=3, attention_topk=4,
                             tier=1)
    assert shared.skipped_events > 0


@pytest.mark.parametrize("attend", ["full", "chunk"])
def test_the_generic_pass_keeps_what_the_fused_cpu_pass_keeps(attend, engine_for, monkeypatch):
    """Off the CPU the pass is SDPA plus the blockwise scores: same kept sets."""
    import sparseety.engine.attention as attention

    engine = engine_for("llama")
    e = EncodedInput(prompt_ids(70, seed=13))
    policy = build_policy("kvzip", 25, {"chunk_size": "30", "attend": attend})
    fused = engine.generate(e, policy, max_new_tokens=4, tier=2)
    monkeypatch.setattr(attention, "reconstruction_attention", lambda *args: None)
    generic = engine.generate(e, policy, max_new_tokens=4, tier=2)
    assert generic.kept_positions_final == fused.kept_positions_final
    assert generic.output_ids == fused.output_ids


def test_on_a_hybrid_model_global_layers_are_scored_and_sliding_layers_keep_their_newest(engine_for):
    """Gemma-style layers: the reconstruction pass scores the global layer's context slots; a sliding layer
    holds only its window (8), so a budget of 6 keeps its 6 newest; and the pass leaves no trace."""
    engine = engine_for("gemma3")
    e = EncodedInput(prompt_ids(30, seed=4))
    result = engine.generate(e, build_policy("kvzip", 6), max_new_tokens=4, tier=2)
    batched = engine.generate_batch([e], build_policy("kvzip", 6), GenerationOptions(max_new_tokens=4, tier=2),
                                    prefill_chunk=7)[0]
    assert batched.output_ids == result.output_ids and batched.kept_positions_final == result.kept_positions_final
    seen = 30 + 4 - 1
    for layer in (0, 1, 2):
        for positions in result.kept_positions_final[str(layer)].values():
            assert positions == list(range(seen - 6, seen))
    global_heads = list(result.kept_positions_final["3"].values())
    assert sum(len(p) for p in global_heads) == 6 * len(global_heads)  # its heads' own counts, the budget in all
    for positions in global_heads:
        assert positions[:4] == [0, 1, 2, 3]  # the sinks, then what kvzip and decode kept
    assert result.arrays["window.position"].tolist()[:3] == [30 - 8] * 3  # step 0: the prompt's edge, unmoved

@pytest.mark.parametrize("document", [False, True])
def test_a_split_layer_computes_what_the_unsplit_layer_does(document, engine_for, monkeypatch):
    """Per-head counts that happen to be uniform: the split storage (one row, other heads masked) must give the
    tokens, kept sets and evictions of the ordinary per-layer cache, decode evictions included."""
    from sparseety.policies.kvzip import KVzipPolicy

    engine = engine_for("llama")
    ids = prompt_ids(44, seed=21)
    encoded = EncodedInput(ids, compress_len=36) if document else EncodedInput(ids)
    shared = engine.generate(encoded, build_policy("kvzip", 12, {"layerwise": "true", "per_head": "false"}),
                             max_new_tokens=10, tier=2)
    monkeypatch.setattr(KVzipPolicy, "allocate", lambda self, scores, budgets: {
        layer: [budget] * scores[layer].shape[1] for layer, budget in budgets.items()})
    split = engine.generate(encoded, build_policy("kvzip", 12, {"layerwise": "true"}), max_new_tokens=10, tier=2)
    assert split.output_ids == shared.output_ids
    assert split.kept_positions_final == shared.kept_positions_final
    for column in ("step", "layer", "kv_head", "position"):
        order_s = np.lexsort([shared.arrays[f"evicted.{c}"] for c in ("position", "kv_head", "layer", "step")])
        order_p = np.lexsort([split.arrays[f"evicted.{c}"] for c in ("position", "kv_head", "layer", "step")])
        assert (split.arrays[f"evicted.{column}"][order_p] == shared.arrays[f"evicted.{column}"][order_s]).all()
    np.testing.assert_allclose(split.arrays["importance"].astype(np.float32),
                               shared.arrays["importance"].astype(np.float32), rtol=1e-2, atol=1e-3)
    assert split.kv_cache_bytes_peak == shared.kv_cache_bytes_peak


def test_a_policy_declares_its_reconstruction_pass_through_the_policy_interface(engine_for, tokenizer):
    """The engine knows reconstruction passes through :class:`Policy` only: a policy that is not kvzip declares its
    own chunks (here: the context repeated once, scoring its second half) and the engine feeds exactly those,
    scores from them, leaves no trace of them and evicts to the budget; a policy without a pass declares none."""
    from dataclasses import dataclass
    from typing import ClassVar

    from sparseety.policies.base import Observation, Policy, ReconstructionChunk

    fed: list[list[int]] = []

    @dataclass
    class RepeatHalf(Policy):
        name: ClassVar[str] = "repeat-half"
        reconstructs: ClassVar[bool] = True

        def reconstruction_chunks(self, context_ids: list[int], tokenizer: object) -> list[ReconstructionChunk]:
            half = len(context_ids) // 2
            return [ReconstructionChunk(tuple(context_ids), half, len(context_ids), 1)]

        def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
            assert obs.attention is not None
            return obs.attention, None

    engine = engine_for("llama")
    prompt = prompt_ids(24, seed=3)
    hook = engine.model.register_forward_pre_hook(
        lambda _m, args, kwargs: fed.append(kwargs["input_ids"][0].tolist()), with_kwargs=True)
    try:
        result = engine.generate(EncodedInput(prompt), RepeatHalf(budget=10), max_new_tokens=3, tier=2)
    finally:
        hook.remove()
    assert fed[1] == prompt[0].tolist()  # the prefill, then the declared chunk
    assert result.kv_cache_bytes_peak < result.kv_cache_bytes_dense
    kept = result.kept_positions_final["0"]["0"]
    assert len(kept) == 10 and all(p >= 12 for p in kept)  # the pass scored the second half; decode keeps to 10
    assert build_policy("h2o", 8).reconstruction_chunks(prompt[0].tolist(), tokenizer) == []
