"""Speculative decoding by prompt lookup: drafted tokens are verified, rejected ones never output."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import HEAD_DIM, KV_HEADS, prompt_ids, repetitive_ids, run

from sparseety.errors import SparseetyError
from sparseety.policies import build_policy

PROMPT, NEW = 42, 16


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("draft", [2, 4])
def test_speculative_dense_equals_plain_greedy(draft, family, engine_for, greedy_reference):
    ids = repetitive_ids(PROMPT)
    result = run(engine_for(family), ids, build_policy("dense"), NEW, tier=3, speculative=draft)
    assert result.output_ids == greedy_reference(family, ids, NEW)
    assert result.draft_tokens > 0, "a repetitive prompt must yield prompt-lookup drafts"
    assert 0 <= result.draft_rejected <= result.draft_tokens
    # the cache holds exactly the accepted sequence: rejected drafts were cropped
    for heads in result.kept_positions_final.values():
        assert all(kept == list(range(PROMPT + NEW - 1)) for kept in heads.values())


def test_draft_accounting_matches_tokens_fed(engine_for):
    """Tokens fed = prompt + one per verify forward + drafts; minus rejected = the P + G - 1 the cache saw
    (plus the last token when it was an accepted draft: it was fed, then cropped as the final token never is)."""
    engine = engine_for("mixtral")
    result = run(engine, repetitive_ids(PROMPT), build_policy("dense"), NEW, tier=3, speculative=3)
    forwards = result.arrays["step_importance"].shape[0]
    fed = PROMPT + (forwards - 1) + result.draft_tokens
    assert forwards < NEW, "drafts were accepted, so fewer forwards than tokens"
    assert result.arrays["router.0"].shape[0] == fed
    a = result.arrays
    last_was_draft = int(((a["drafted.position"] == PROMPT + NEW - 1) & (a["drafted.rejected"] == 0)).any())
    assert fed - result.draft_rejected - last_was_draft == PROMPT + NEW - 1


def test_no_drafts_on_a_prompt_without_repeats(engine_for, greedy_reference):
    ids = prompt_ids(PROMPT, seed=21)
    result = run(engine_for("llama"), ids, build_policy("dense"), 4, tier=2, speculative=3)
    assert result.output_ids == greedy_reference("llama", ids, 4)
    assert result.draft_rejected <= result.draft_tokens


def _check_budget(result, budget, seen):
    a = result.arrays
    for layer, heads in result.kept_positions_final.items():
        for head, kept in heads.items():
            sel = (a["evicted.layer"] == int(layer)) & (a["evicted.kv_head"] == int(head))
            evicted = a["evicted.position"][sel].tolist()
            assert len(kept) <= budget
            assert len(set(evicted)) == len(evicted) and not set(kept) & set(evicted)
            assert sorted(kept + evicted) == list(range(seen)), "evicted + kept must equal seen"


@pytest.mark.parametrize("draft", [2, 4])
def test_speculative_with_streaming_budget(draft, engine_for):
    engine = engine_for("llama")
    budget, sinks = 16, 4
    result = run(engine, repetitive_ids(PROMPT), build_policy("streaming", budget), NEW, tier=2, speculative=draft)
    seen = PROMPT + NEW - 1
    assert len(result.output_ids) == NEW
    assert result.draft_tokens > 0 and result.draft_rejected <= result.draft_tokens
    _check_budget(result, budget, seen)
    for heads in result.kept_positions_final.values():
        for kept in heads.values():  # sinks, then one contiguous run of the newest positions
            assert kept[:sinks] == list(range(sinks))
            assert kept[sinks:] == list(range(seen - len(kept) + sinks, seen))
    assert result.kv_cache_bytes_peak <= 2 * engine.num_layers * KV_HEADS * budget * HEAD_DIM * 4


SMALL = [("streaming", 6, {}), ("h2o", 4, {}), ("tova", 3, {}), ("snapkv", 4, {"window": "2"}),
         ("knorm", 3, {}), ("random", 3, {})]


@pytest.mark.parametrize(("name", "budget", "opts"), SMALL, ids=[s[0] for s in SMALL])
def test_speculative_with_a_budget_smaller_than_the_drafts(name, budget, opts, engine_for):
    """A verify forward feeds up to draft + 1 tokens; a budget below that must not crash the run.

    Either the run completes with the budget held, or it is refused up front with a SparseetyError.
    """
    try:
        result = run(engine_for("llama"), repetitive_ids(PROMPT), build_policy(name, budget, opts), NEW,
                     tier=2, speculative=4)
    except SparseetyError:
        return
    assert len(result.output_ids) == NEW
    _check_budget(result, budget, PROMPT + NEW - 1)


@pytest.mark.parametrize("k", [8, 20])
def test_speculative_topk_attention_is_lossless(k, engine_for):
    """Greedy verification of drafts must reproduce the non-speculative run of the same sparse attention:
    every verified query row has to attend to its own top-k keys, as a one-token decode step would."""
    engine, ids = engine_for("llama"), repetitive_ids(PROMPT)
    plain = run(engine, ids, build_policy("topk_attention", k), NEW, tier=1)
    drafted = run(engine, ids, build_policy("topk_attention", k), NEW, tier=1, speculative=3)
    assert drafted.draft_tokens > 0
    assert drafted.output_ids == plain.output_ids


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_drafted_tokens_recorded_per_token(family, engine_for):
    """Every drafted token is logged with its step and position; the rejected ones sum to draft_rejected,
    and an accepted draft is the token the sequence holds at its position."""
    engine = engine_for(family)
    result = run(engine, repetitive_ids(PROMPT), build_policy("dense"), NEW, tier=1, speculative=3)
    a = result.arrays
    assert len(a["drafted.step"]) == result.draft_tokens > 0
    assert int(a["drafted.rejected"].sum()) == result.draft_rejected
    accepted = a["drafted.rejected"] == 0
    sequence = np.asarray(result.token_ids)
    inside = a["drafted.position"][accepted] < len(sequence)
    assert (sequence[a["drafted.position"][accepted][inside]] == a["drafted.token_id"][accepted][inside]).all()
    assert (np.diff(a["drafted.step"]) >= 0).all()
    # The first rejected draft of each step is where the model disagreed with the draft.
    for step in np.unique(a["drafted.step"][~accepted]):
        first = np.flatnonzero((a["drafted.step"] == step) & ~accepted)[0]
        position = a["drafted.position"][first]
        if position < len(sequence):
            assert sequence[position] != a["drafted.token_id"][first]
