"""``kvzip``: options, the reconstruction inputs (kvpress's prompts and chunking), its scoring and its decode rule."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sparseety.engine.reconstruct import reconstruction_scores
from sparseety.errors import ConfigError
from sparseety.policies import build_policy
from sparseety.policies.base import Observation
from sparseety.policies.kvzip import PREVIOUS_TAIL, REPEAT_PART_PROMPT, REPEAT_PROMPT, ReconstructionChunk, template_parts

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "USER", "BOT", "END", "Repeat", "the", "previous", "context", "exactly",
         ".", "part", "of", ",", "starting", "with"] + [f"w{i}" for i in range(40)]


def tokenizer(template: str | None = None) -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
    tok.chat_template = template
    return tok


TEMPLATE = ("{% for m in messages %}<bos> USER {{ m['content'] }} END {% endfor %}"
            "{% if add_generation_prompt %}BOT {% endif %}")


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("options", "field"), [
    ({"sinks": "-1"}, "sinks"), ({"chunk_size": "0"}, "chunk_size"), ({"window": "-2"}, "window"),
    ({"chunk_size": "lots"}, "chunk_size"), ({"sink": "4"}, "sink"), ({"layerwise": "maybe"}, "layerwise"),
    ({"per_head": "2"}, "per_head"), ({"attend": "context"}, "attend"),
])
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        build_policy("kvzip", 16, options)
    with pytest.raises(ConfigError, match="budget"):
        build_policy("kvzip", None)


def test_one_chunk_without_a_template_is_the_repeat_prompt_a_newline_and_the_context():
    tok = tokenizer()
    context = ids(tok, "w1 w2 w3 w4 w5 w6")
    (chunk,) = build_policy("kvzip", 4).reconstruction_chunks(context, tok)
    assert chunk == ReconstructionChunk(tuple(ids(tok, REPEAT_PROMPT) + ids(tok, "\n") + context), 0, 6, 0)
    assert ids(tok, REPEAT_PROMPT) == [7, 8, 9, 10, 11, 12]


def test_long_contexts_are_reconstructed_in_chunks_quoting_the_previous_tail():
    tok = tokenizer()
    context = [20 + (i % 30) for i in range(45)]
    chunks = build_policy("kvzip", 4, {"chunk_size": "20"}).reconstruction_chunks(context, tok)
    assert [(c.start, c.end, c.sinks) for c in chunks] == [(0, 20, 0), (20, 40, 4), (40, 45, 4)]
    part = ids(tok, REPEAT_PART_PROMPT)
    assert chunks[1].ids == tuple(part + context[20 - PREVIOUS_TAIL : 20] + context[20:40])
    assert chunks[2].ids == tuple(part + context[40 - PREVIOUS_TAIL : 40] + context[40:])
    assert not any(c.local for c in chunks)
    local = build_policy("kvzip", 4, {"chunk_size": "20", "attend": "chunk"}).reconstruction_chunks(context, tok)
    assert all(c.local for c in local) and [c.ids for c in local] == [c.ids for c in chunks]


def test_the_chat_template_header_is_neither_repeated_nor_scored_and_its_suffix_follows_the_prompt():
    tok = tokenizer(TEMPLATE)
    prefix, suffix = template_parts(tok)
    assert prefix == ids(tok, "<bos> USER") and suffix == ids(tok, "END BOT")
    context = prefix + ids(tok, "w1 w2 w3")
    (chunk,) = build_policy("kvzip", 2).reconstruction_chunks(context, tok)
    assert (chunk.start, chunk.end, chunk.sinks) == (2, 5, 2)
    assert chunk.ids == tuple(ids(tok, REPEAT_PROMPT) + suffix + ids(tok, "w1 w2 w3"))
    (plain,) = build_policy("kvzip", 2).reconstruction_chunks(ids(tok, "w1 w2 w3"), tok)  # no header: all of it
    assert (plain.start, plain.end) == (0, 3)


def naive_scores(query, key, scaling, chunk):
    """Full probability matrix over kvpress's key subset, then the max over rows and group."""
    b, h, q, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    cols = list(range(chunk.sinks)) + list(range(chunk.start, chunk.end)) + list(range(n - q, n))
    sub = key[:, :, cols].repeat_interleave(h // kvh, dim=1)  # [b, h, m, d]
    logits = query @ sub.transpose(-1, -2) * scaling  # [b, h, q, m]
    m = len(cols)
    own = m - q
    mask = torch.zeros(q, m, dtype=torch.bool)
    for i in range(q):
        mask[i, own + i + 1 :] = True
    probs = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
    part = probs[..., chunk.sinks : chunk.sinks + chunk.end - chunk.start]
    return part.reshape(b, kvh, h // kvh, q, -1).amax(dim=(2, 3))


@pytest.mark.parametrize("block", [1, 3, 256])
@pytest.mark.parametrize("chunk", [ReconstructionChunk((0,) * 7, 0, 10, 0), ReconstructionChunk((0,) * 7, 12, 20, 4)])
def test_reconstruction_scores_equal_the_full_matrix_at_any_block(block, chunk):
    g = torch.Generator().manual_seed(0)
    n_context, q = 20, len(chunk.ids)
    query = torch.randn(1, 6, q, 8, generator=g)
    key = torch.randn(1, 2, n_context + q, 8, generator=g)
    got = reconstruction_scores(query, key, 0.35, chunk, block=block)
    torch.testing.assert_close(got, naive_scores(query, key, 0.35, chunk), rtol=1e-5, atol=1e-6)


def obs(positions, attention, state=None, prefill=True):
    p = torch.tensor([[positions]])
    return Observation(layer=0, num_layers=1, step=0 if prefill else 1, prefill=prefill, positions=p,
                       keys=torch.zeros(1, 1, len(positions), 2), attention=torch.tensor([[attention]]),
                       state=None if state is None else torch.tensor([[state]]), seed=0)


def test_prefill_scores_are_the_reconstruction_scores_with_sinks_kept():
    policy = build_policy("kvzip", 4, {"sinks": "2"})
    scores, state = policy.score(obs([0, 1, 2, 3, 4], [0.0, 0.1, 0.5, 0.2, 0.3]))
    assert scores[0, 0].tolist() == [float("inf"), float("inf"), 0.5, pytest.approx(0.2), pytest.approx(0.3)]
    assert state[0, 0].tolist() == pytest.approx([0.0, 0.1, 0.5, 0.2, 0.3])


def test_decode_steps_max_accumulate_and_protect_the_recent_window():
    policy = build_policy("kvzip", 5, {"sinks": "1", "window": "2"})
    scores, state = policy.score(obs([0, 1, 2, 3, 7, 8], [0.1, 0.4, 0.1, 0.1, 0.1, 0.1],
                                     state=[0.2, 0.3, 0.0, 0.6, 0.5, 0.0], prefill=False))
    assert state[0, 0].tolist() == pytest.approx([0.2, 0.4, 0.1, 0.6, 0.5, 0.1])
    assert scores[0, 0, 0] == float("inf") and scores[0, 0, 4:].tolist() == [float("inf")] * 2
    assert scores[0, 0, 1:4].tolist() == pytest.approx([0.4, 0.1, 0.6])


@pytest.mark.parametrize("chunk", [ReconstructionChunk((0,) * 9, 0, 20, 0), ReconstructionChunk((0,) * 9, 6, 14, 4),
                                   ReconstructionChunk((0,) * 9, 2, 20, 2)])
def test_the_fused_cpu_pass_equals_sdpa_plus_the_blockwise_scores(chunk):
    from sparseety.engine.reconstruct import reconstruction_attention

    g = torch.Generator().manual_seed(1)
    q = len(chunk.ids)
    query = torch.randn(1, 6, q, 8, generator=g)
    key, value = torch.randn(1, 2, 20 + q, 8, generator=g), torch.randn(1, 2, 20 + q, 8, generator=g)
    fused = reconstruction_attention(query, key, value, 0.35, chunk)
    assert fused is not None
    out, scores = fused
    mask = torch.arange(20 + q).unsqueeze(0) <= torch.arange(q).unsqueeze(1) + 20
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.35,
                                                                enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores, naive_scores(query, key, 0.35, chunk), rtol=1e-5, atol=1e-6)


def kept_score(scores: dict[int, torch.Tensor], budgets: dict[int, int]) -> float:
    """The summed score each layer's heads keep with their ``budgets[layer]`` best slots."""
    return sum(float(s.sort(dim=-1, descending=True).values[..., : budgets[layer]].sum()) for layer, s in scores.items())


SHARED = {"per_head": "false"}


def test_shared_heads_share_the_budget_by_score_and_layerwise_keeps_it_uniform():
    layer0 = torch.tensor([[[9.0, 8, 7, 6, 5, 4], [4.0, 5, 6, 7, 8, 9]]])  # every slot scores high
    layer1 = torch.tensor([[[10.0, 1, 1, 1, 1, 1], [1.0, 10, 1, 1, 1, 1]]])  # one slot per head matters
    scores, uniform = {0: layer0, 1: layer1}, {0: 3, 1: 3}
    assert build_policy("kvzip", 3, SHARED).allocate(scores, uniform) == {0: 5, 1: 1}
    assert build_policy("kvzip", 3, {**SHARED, "layerwise": "true"}).allocate(scores, uniform) == uniform
    assert build_policy("kvzip", 3, SHARED).allocate({0: layer0}, {0: 3}) == {0: 3}  # one layer: nothing to share


def test_per_head_counts_rank_every_layer_head_and_slot_at_once():
    """The default: the best 2 layers x 2 heads x 3 = 12 slots over everything; each head's best slot first
    (so every head keeps one), other ties to the lower layer/head/slot."""
    layer0 = torch.tensor([[[9.0, 8, 7, 6, 5, 4], [0.5, 0.4, 0.3, 0.2, 0.1, 0.0]]])
    layer1 = torch.tensor([[[10.0, 1, 1, 1, 1, 1], [3.0, 3, 3, 3, 3, 3]]])
    scores, uniform = {0: layer0, 1: layer1}, {0: 3, 1: 3}
    # the four heads' best, then 8..5 (layer 0, head 0), then three more of the tied 3.0s (the lower slots)
    assert build_policy("kvzip", 3).allocate(scores, uniform) == {0: [6, 1], 1: [1, 4]}
    # layerwise: each layer's own 6: its heads' best, then 8, 7, 6, 5 / four of the 3.0s
    assert build_policy("kvzip", 3, {"layerwise": "true"}).allocate(scores, uniform) == {0: [5, 1], 1: [1, 5]}
    assert build_policy("kvzip", 2, {"layerwise": "true"}).allocate(scores, {0: 2, 1: 2}) == {0: [3, 1], 1: [1, 3]}
    assert build_policy("kvzip", 2).allocate(scores, {0: 2, 1: 2}) == {0: [5, 1], 1: [1, 1]}


def test_per_head_counts_keep_the_same_memory_as_uniform_budgets():
    g = torch.Generator().manual_seed(0)
    scores = {layer: torch.rand(1, 3, 50, generator=g) ** (1 + layer) for layer in range(4)}
    for options in ({}, {"layerwise": "true"}):
        counts = build_policy("kvzip", 10, options).allocate(scores, dict.fromkeys(range(4), 10))
        assert sum(sum(c) for c in counts.values()) == 4 * 3 * 10 and min(min(c) for c in counts.values()) >= 1
        assert len({c for per_layer in counts.values() for c in per_layer}) > 1


@pytest.mark.parametrize("seed", range(6))
def test_the_shares_keep_the_most_score_any_split_of_the_same_memory_can(seed):
    """Brute force over every split of the total (each layer at least one slot per head)."""
    import itertools

    g = torch.Generator().manual_seed(seed)
    layers, n, budget = 3, 7, 3
    scores = {layer: torch.rand(1, 2, n, generator=g) ** (1 + 3 * layer % 4) for layer in range(layers)}
    shares = build_policy("kvzip", budget, SHARED).allocate(scores, dict.fromkeys(range(layers), budget))
    assert sum(shares.values()) == layers * budget and min(shares.values()) >= 1
    best = max(kept_score(scores, dict(enumerate(split)))
               for split in itertools.product(range(1, n + 1), repeat=layers) if sum(split) == layers * budget)
    assert kept_score(scores, shares) == pytest.approx(best)
