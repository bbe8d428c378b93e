"""Token pruning on tiny models: schedule 0 equals dense, the pruned set is exactly the lowest-scored tokens
(scores computed independently from q and k), later layers never hold a pruned token, slot counts and KV
bytes are exact, positions stay right in decode (against a hand-built layer-by-layer reference), and every
KV policy composes with pruning.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import HEAD_DIM, KV_HEADS, prompt_ids, repetitive_ids, run
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparseety.engine import EncodedInput
from sparseety.policies import build_policy
from sparseety.prune_schedule import parse_prune_schedule

PROMPT, NEW = 40, 6
SEEN = PROMPT + NEW - 1


# -- independent references ----------------------------------------------------------------------------

def attention_scores(attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     window: int) -> torch.Tensor:
    """``[r]`` attention the last ``window`` rows pay to each of ``r`` rows (causal, mean over rows and heads).

    ``x`` ``[1, r, d]`` is the attention input (after the layer norm), ``cos``/``sin`` ``[1, r, head_dim]``.
    """
    r = x.shape[1]
    q = attn.q_proj(x).view(1, r, -1, HEAD_DIM).transpose(1, 2)
    k = attn.k_proj(x).view(1, r, -1, HEAD_DIM).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5
    logits = logits.masked_fill(torch.ones(r, r, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits.float(), dim=-1)[0, :, -window:, :].mean(dim=(0, 1))


def first_point_scores(model: torch.nn.Module, ids: torch.Tensor, layer: int, window: int = 1) -> torch.Tensor:
    """Scores at the first pruning layer from a never-wrapped twin (every row is still present there)."""
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states[layer]  # input of `layer`
        block = model.model.layers[layer]
        x = block.input_layernorm(hidden)
        cos, sin = model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
        return attention_scores(block.self_attn, x, cos, sin, window)


def expected_pruned(scores: list[float], positions: list[int], fraction: float, prompt_len: int,
                    sinks: int = 4, keep_recent: int = 8) -> list[int]:
    """Lowest-scored unprotected positions; ties prune the higher position (the lower one is kept)."""
    r = len(positions)
    protected = [p < sinks or p >= prompt_len - max(1, keep_recent) for p in positions]
    count = min(int(fraction * r + 0.5), r - sum(protected))
    candidates = sorted((i for i in range(r) if not protected[i]), key=lambda i: (scores[i], -positions[i]))
    return sorted(positions[i] for i in candidates[:count])


def pruned_at(result, layer: int) -> list[int]:
    a = result.arrays
    return sorted(a["pruned.position"][a["pruned.layer"] == layer].tolist())


def manual_generate(model: torch.nn.Module, ids: torch.Tensor, kept_after: dict[int, set[int]],
                    new_tokens: int) -> list[int]:
    """Greedy generation layer by layer on a never-wrapped model with a plain ``DynamicCache``: after
    layer ``L`` in ``kept_after`` only those positions continue (hidden rows, RoPE rows, cache)."""
    m = model.model
    cache = DynamicCache(config=model.config)
    rows = torch.arange(ids.shape[1])
    out: list[int] = []
    with torch.inference_mode():
        h = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(h, rows[None])
        for index, block in enumerate(m.layers):
            if index - 1 in kept_after:
                keep = torch.tensor([i for i, p in enumerate(rows.tolist()) if p in kept_after[index - 1]])
                h, rows = h[:, keep], rows[keep]
            h = block(h, attention_mask=None, position_ids=rows[None], past_key_values=cache, use_cache=True,
                      position_embeddings=(cos[:, rows], sin[:, rows]))
        token = int(model.lm_head(m.norm(h[:, -1:])).argmax(-1))
        out.append(token)
        for step in range(new_tokens - 1):
            position = torch.tensor([[ids.shape[1] + step]])
            h = m.embed_tokens(torch.tensor([[token]]))
            cos, sin = m.rotary_emb(h, position)
            for block in m.layers:
                h = block(h, attention_mask=None, position_ids=position, past_key_values=cache, use_cache=True,
                          position_embeddings=(cos, sin))
            token = int(model.lm_head(m.norm(h)).argmax(-1))
            out.append(token)
    return out


# -- schedule 0 is dense ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe", "mixtral"])
def test_zero_fraction_equals_dense(family, engine_for, greedy_reference):
    ids = prompt_ids(PROMPT)
    result = run(engine_for(family), ids, build_policy("dense"), NEW, tier=2, prune=parse_prune_schedule("1:0"))
    assert result.output_ids == greedy_reference(family, ids, NEW)
    assert result.pruned_tokens == 0 and result.arrays["pruned.position"].size == 0
    assert result.arrays["layer_tokens"].tolist() == [PROMPT] * engine_for(family).num_layers
    assert result.to_json()["sparsity"]["prune"]["schedule"] == "1:0"


# -- the pruned set -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("window", [1, 4])
def test_first_pruned_set_is_the_lowest_scored(family, window, engine_for, reference_model):
    ids = prompt_ids(PROMPT, seed=3)
    schedule = parse_prune_schedule("1:0.4", {"window": str(window)})
    result = run(engine_for(family), ids, build_policy("dense"), 2, tier=1, prune=schedule)
    scores = first_point_scores(reference_model(family), ids, 1, window)
    expected = expected_pruned(scores.tolist(), list(range(PROMPT)), 0.4, PROMPT)
    assert len(expected) == 16  # round(0.4 * 40), all unprotected
    assert pruned_at(result, 1) == expected
    a = result.arrays
    np.testing.assert_allclose(a["pruned.score"], scores[a["pruned.position"]].numpy(), rtol=1e-4, atol=1e-6)
    assert set(a["pruned.kv_head"].tolist()) == {-1} and set(a["pruned.step"].tolist()) == {0}
    assert a["pruned.token_id"].tolist() == ids[0, a["pruned.position"]].tolist()


def test_second_pruned_set_is_the_lowest_scored_among_the_survivors(engine_for):
    """Scores at the second point from q/k recomputed on that layer's own (already pruned) inputs."""
    engine = engine_for("llama")
    ids = prompt_ids(PROMPT, seed=5)
    captured: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []
    attn = engine.model.model.layers[2].self_attn

    def capture(module, args, kwargs):
        if not captured:
            captured.append((kwargs["hidden_states"].clone(), tuple(t.clone() for t in kwargs["position_embeddings"])))

    handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        result = run(engine, ids, build_policy("dense"), 2, tier=1, prune=parse_prune_schedule("0:0.3,2:0.5"))
    finally:
        handle.remove()
    survivors = sorted(set(range(PROMPT)) - set(pruned_at(result, 0)))
    x, (cos, sin) = captured[0]
    assert x.shape[1] == len(survivors) == PROMPT - 12
    with torch.inference_mode():
        scores = attention_scores(attn, x, cos, sin, 1)
    assert pruned_at(result, 2) == expected_pruned(scores.tolist(), survivors, 0.5, PROMPT)
    assert result.arrays["layer_tokens"].tolist() == [40, 28, 28, 14]
    assert result.pruned_tokens == 12 + 14


def test_ties_keep_the_lower_position():
    """Equal scores everywhere: the highest unprotected positions go (select_keep's rule)."""
    from sparseety.engine.prune import PruneRun

    prune = PruneRun(parse_prune_schedule("0:0.5", {"sinks": "2", "keep_recent": "3"}), num_layers=2)
    prune.begin(q_len=12, seen=0, prunable=True)
    prune.take_scores(torch.full((1, 4, 1, 12), 1 / 12))
    hidden = torch.arange(12.0).view(1, 12, 1)
    args, kwargs = prune.before_layer(1, (hidden,), {"position_ids": torch.arange(12)[None]}, None)
    # protected: sinks 0, 1 and the last three 9, 10, 11; round(0.5 * 12) = 6 of the 7 candidates 2..8 go
    assert prune.events[0][1].tolist() == [3, 4, 5, 6, 7, 8]
    assert args[0].view(-1).tolist() == [0.0, 1.0, 2.0, 9.0, 10.0, 11.0]
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 9, 10, 11]]
    assert prune.layer_tokens == [12, 6]


# -- caches, memory and positions -----------------------------------------------------------------------------

def test_later_layers_hold_no_pruned_token_and_bytes_are_exact(engine_for):
    engine = engine_for("llama")
    result = run(engine, prompt_ids(PROMPT), build_policy("dense"), NEW, tier=2, prune=parse_prune_schedule("0:0.5,1:0.25"))
    first, second = set(pruned_at(result, 0)), set(pruned_at(result, 1))
    assert len(first) == 20 and len(second) == 5 and not first & second
    slots = []
    for layer, heads in result.kept_positions_final.items():
        gone = (first if int(layer) >= 1 else set()) | (second if int(layer) >= 2 else set())
        for kept in heads.values():
            assert kept == sorted(set(range(SEEN)) - gone)
        slots.append(len(heads["0"]))
    assert slots == [SEEN, SEEN - 20, SEEN - 25, SEEN - 25]
    assert result.arrays["layer_tokens"].tolist() == [40, 20, 15, 15]
    assert result.kv_cache_bytes_peak == 2 * sum(slots) * KV_HEADS * HEAD_DIM * 4
    assert result.kv_cache_bytes_dense == 2 * SEEN * 4 * KV_HEADS * HEAD_DIM * 4


@pytest.mark.parametrize("schedule", ["1:0.5", "0:0.3,2:0.6"])
def test_decode_matches_a_hand_built_reference(schedule, engine_for, reference_model):
    """Generate on the engine with pruning, then rebuild the same computation layer by layer on a plain model."""
    ids = prompt_ids(PROMPT, seed=7)
    result = run(engine_for("llama"), ids, build_policy("dense"), NEW, tier=1, prune=parse_prune_schedule(schedule))
    assert result.pruned_tokens > 0
    kept_after, alive = {}, set(range(PROMPT))
    for layer, _ in parse_prune_schedule(schedule).points:
        alive = alive - set(pruned_at(result, layer))
        kept_after[layer] = set(alive)
    assert result.output_ids == manual_generate(reference_model("llama"), ids, kept_after, NEW)


def test_long_document_prunes_only_the_context(engine_for):
    engine = engine_for("llama")
    ids = prompt_ids(PROMPT)
    context = 30
    result = engine.generate(EncodedInput(ids, compress_len=context), build_policy("dense"), max_new_tokens=NEW,
                             tier=2, prune=parse_prune_schedule("1:0.5"))
    pruned = pruned_at(result, 1)
    assert len(pruned) == 15 and max(pruned) < context - 8
    assert result.arrays["layer_tokens"].tolist() == [30, 30, 15, 15]
    for layer in ("2", "3"):
        assert result.kept_positions_final[layer]["1"] == sorted(set(range(SEEN)) - set(pruned))


def test_probe_arrays_stay_aligned_with_positions(engine_for):
    """Router and activation arrays index every fed token; rows a pruned layer never computed are NaN."""
    schedule = parse_prune_schedule("0:0.5")
    dense = run(engine_for("llama"), prompt_ids(PROMPT), build_policy("dense"), NEW, tier=2, prune=schedule)
    moe = run(engine_for("qwen2_moe"), prompt_ids(PROMPT), build_policy("dense"), NEW, tier=2, prune=schedule)
    for result, layers, name in ((dense, 4, "activation"), (moe, 3, "router")):
        pruned = pruned_at(result, 0)
        assert len(pruned) == 20
        for layer in range(layers):
            values = result.arrays["activation.maxabs"][layer] if name == "activation" \
                else result.arrays[f"router.{layer}"][:, 0]
            assert values.shape == (SEEN,)
            missing = np.flatnonzero(np.isnan(values.astype(np.float32))).tolist()
            assert missing == (pruned if layer >= 1 else []), (name, layer)


def test_speculative_decoding_with_pruning_gives_the_same_tokens(engine_for):
    engine, ids = engine_for("llama"), repetitive_ids(PROMPT)
    schedule = parse_prune_schedule("1:0.5")
    plain = run(engine, ids, build_policy("dense"), 8, tier=1, prune=schedule)
    drafted = run(engine, ids, build_policy("dense"), 8, tier=1, prune=schedule, speculative=3)
    assert drafted.draft_tokens > 0
    assert drafted.output_ids == plain.output_ids
    assert pruned_at(drafted, 1) == pruned_at(plain, 1)


# -- every KV policy composes --------------------------------------------------------------------------------

POLICIES = [
    ("dense", None, {}), ("streaming", 16, {}), ("h2o", 16, {}), ("snapkv", 16, {"window": "4"}),
    ("pyramid", 16, {"window": "4", "beta": "4"}), ("tova", 16, {}), ("knorm", 16, {}), ("random", 16, {}),
    ("topk_attention", 8, {}),
]


@pytest.mark.parametrize("name,budget,opts", POLICIES, ids=[p[0] for p in POLICIES])
def test_every_policy_runs_with_pruning_and_keeps_its_budget(name, budget, opts, engine_for):
    """Per layer and head: kept, evicted and pruned-earlier positions partition every token seen; budgets hold."""
    engine = engine_for("llama")
    policy = build_policy(name, budget, opts)
    result = run(engine, prompt_ids(PROMPT), policy, NEW, tier=3, prune=parse_prune_schedule("1:0.5"))
    pruned = set(pruned_at(result, 1))
    assert len(pruned) == 20 and result.pruned_tokens == 20
    a = result.arrays
    for layer in range(engine.num_layers):
        limit = policy.layer_budget(layer, engine.num_layers, SEEN) if policy.evicts else None
        for head in range(KV_HEADS):
            kept = result.kept_positions_final[str(layer)][str(head)]
            evicted = []
            if "evicted.position" in a:
                sel = (a["evicted.layer"] == layer) & (a["evicted.kv_head"] == head)
                evicted = a["evicted.position"][sel].tolist()
            gone = pruned if layer >= 2 else set()
            assert sorted(kept + evicted + sorted(gone)) == list(range(SEEN)), (layer, head)
            if limit is not None:
                assert len(kept) <= limit
    if name == "topk_attention":
        assert result.skipped_events > 0


# -- bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("8", "not layer:fraction"), ("a:0.3", "layer 'a'"), ("8:x", "fraction 'x'"), ("8:1", "must be in [0, 1)"),
    ("8:-0.1", "must be in [0, 1)"), ("8:0.3,4:0.2", "strictly increasing"), ("8:0.3,8:0.2", "strictly increasing"),
    ("-1:0.3", "non-negative"), ("", "not layer:fraction"),
])
def test_malformed_schedules_are_config_errors(text, message):
    from sparseety.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse_prune_schedule(text)


@pytest.mark.parametrize("options,message", [
    ({"foo": "1"}, "unknown option 'foo'"), ({"window": "0"}, "window must be an integer >= 1"),
    ({"sinks": "two"}, "sinks='two' is not a valid int"), ({"keep_recent": "-1"}, "keep_recent must be"),
])
def test_bad_prune_options(options, message):
    from sparseety.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_prune_schedule("1:0.5", options)


def test_layers_outside_the_model_and_empty_results_fail_before_the_model_runs(engine_for):
    from sparseety.errors import ConfigError, InputError

    engine = engine_for("llama")
    forwards = []
    handle = engine.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ConfigError, match=r"layer 3 is outside 0\.\.2"):
            run(engine, prompt_ids(8), build_policy("dense"), 2, prune=parse_prune_schedule("3:0.5"))
        with pytest.raises(InputError, match="would leave no token of the 1-token prompt after layer 0"):
            run(engine, prompt_ids(1), build_policy("dense"), 2, prune=parse_prune_schedule("0:0.5"))
    finally:
        handle.remove()
    assert forwards == []
