"""Native sliding-window layers on the tiny hybrid model (``gemma3``: layers 0-2 slide over 8 tokens, layer 3
is global): the window is applied by the hook point, recorded as edges, and freed from the cache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import WINDOW, prompt_ids, run

from sparseety.engine import EncodedInput
from sparseety.engine.cache import SparseLayer
from sparseety.engine.request import GenerationOptions
from sparseety.engine.window import window_edge, window_mask
from sparseety.policies import build_policy

PROMPT, NEW = 30, 6
SLIDING = (0, 1, 2)


def test_layer_windows_read_the_config(engine_for):
    assert engine_for("gemma3").windows == (WINDOW, WINDOW, WINDOW, None)
    assert engine_for("llama").windows == (None,) * 4


def test_window_mask_is_transformers_rule():
    rows = torch.tensor([5, 9])
    keys = torch.arange(10).view(1, 1, 10)
    visible = window_mask(rows, keys, 4)[0, 0]
    assert visible[0].nonzero().flatten().tolist() == [2, 3, 4, 5]  # kv > q - w and kv <= q
    assert visible[1].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert window_edge(9, 4) == 6 and window_edge(2, 4) == 0


def test_dense_records_one_edge_per_step_and_sliding_layer_and_frees_the_rest(engine_for):
    result = run(engine_for("gemma3"), prompt_ids(PROMPT), build_policy("dense"), NEW, tier=2)
    seen = PROMPT + NEW - 1
    rows = sorted(zip(result.arrays["window.step"].tolist(), result.arrays["window.layer"].tolist(),
                      result.arrays["window.position"].tolist()))
    assert rows == sorted((step, layer, PROMPT + step - WINDOW) for step in range(NEW) for layer in SLIDING)
    kv_heads = 2
    assert result.skipped_events == kv_heads * sum(edge for _, _, edge in rows)
    for layer in SLIDING:
        for positions in result.kept_positions_final[str(layer)].values():
            assert positions == list(range(seen - WINDOW + 1, seen))
    for positions in result.kept_positions_final["3"].values():
        assert positions == list(range(seen))
    per_slot = 2 * kv_heads * 16 * 4
    assert result.kv_cache_bytes_peak == per_slot * (seen + 3 * (WINDOW - 1))
    assert result.kv_cache_bytes_dense == per_slot * 4 * seen


def test_a_short_prompt_hides_nothing(engine_for):
    result = run(engine_for("gemma3"), prompt_ids(4), build_policy("dense"), 3, tier=2)
    assert "window.step" not in result.arrays and result.skipped_events == 0


@pytest.mark.parametrize("chunk", [3, 7, 32])
def test_chunked_prefill_gives_the_same_tokens_edges_and_sets(engine_for, chunk):
    engine = engine_for("gemma3")
    encoded = EncodedInput(prompt_ids(PROMPT))
    for policy in (build_policy("dense"), build_policy("streaming", budget=6), build_policy("h2o", budget=10)):
        alone = engine.generate(encoded, policy, max_new_tokens=NEW, tier=2)
        batched = engine.generate_batch([encoded], policy, GenerationOptions(max_new_tokens=NEW, tier=2),
                                        prefill_chunk=chunk)[0]
        assert batched.output_ids == alone.output_ids, policy.name
        assert batched.kept_positions_final == alone.kept_positions_final, policy.name
        assert batched.skipped_events == alone.skipped_events
        for key in ("window.step", "window.layer", "window.position"):
            assert batched.arrays[key].tolist() == alone.arrays[key].tolist()


def test_streaming_budget_below_the_window_binds_sliding_layers_too(engine_for):
    """Budget 6 < window 8: sliding layers keep the 6 newest (the sinks are outside their window), the
    global layer keeps the 4 sinks and the 2 newest; a budget of 20 >= the window binds the global layer only."""
    engine = engine_for("gemma3")
    seen = PROMPT + NEW - 1
    small = run(engine, prompt_ids(PROMPT), build_policy("streaming", budget=6), NEW, tier=2)
    for layer in SLIDING:
        for positions in small.kept_positions_final[str(layer)].values():
            assert positions == list(range(seen - 6, seen))
    for positions in small.kept_positions_final["3"].values():
        assert positions == [0, 1, 2, 3, seen - 2, seen - 1]
    large = run(engine, prompt_ids(PROMPT), build_policy("streaming", budget=20), NEW, tier=2)
    for layer in SLIDING:
        for positions in large.kept_positions_final[str(layer)].values():
            assert positions == list(range(seen - WINDOW + 1, seen))
    for positions in large.kept_positions_final["3"].values():
        assert positions == [0, 1, 2, 3, *range(seen - 16, seen)]


def test_topk_attention_counts_only_what_the_window_let_it_see(engine_for):
    """top-k over a sliding layer picks among the window's keys; what the window hid is not a top-k skip."""
    engine = engine_for("gemma3")
    result = run(engine, prompt_ids(PROMPT), build_policy("topk_attention", budget=4), NEW, tier=2)
    window_skips = 2 * sum(result.arrays["window.position"].tolist())
    # per decode step: sliding layers see WINDOW keys, the global layer seen + 1; top-k keeps 4 of them
    topk_skips = sum(2 * ((WINDOW - 4) * 3 + (PROMPT + step - 4)) for step in range(1, NEW))
    assert result.skipped_events == window_skips + topk_skips


def test_expire_keeps_order_without_a_policy_and_frees_memory():
    layer = SparseLayer(window=4)
    keys = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1).expand(1, 2, 10, 1).contiguous()
    layer.update(keys, keys)
    assert layer.expire() == 7  # positions 0..6 hidden from the next query (position 10)
    assert layer.positions[0, 0].tolist() == [7, 8, 9] and layer.keys[0, 0, :, 0].tolist() == [7.0, 8.0, 9.0]
    layer.update(torch.full((1, 2, 1, 1), 10.0), torch.full((1, 2, 1, 1), 10.0))
    assert layer.expire() == 1
    assert layer.positions[0, 1].tolist() == [8, 9, 10] and layer.values[0, 1, :, 0].tolist() == [8.0, 9.0, 10.0]
    assert layer.nbytes() == 2 * 2 * 3 * 1 * 4


def test_expire_with_heads_out_of_step_frees_what_every_head_can_and_masks_the_rest():
    layer = SparseLayer(window=4)
    keys = torch.zeros(1, 2, 6, 1)
    layer.update(keys, keys)
    layer.evict(torch.tensor([[[4], [0]]]))  # head 0 drops position 4, head 1 drops position 0
    # next query at 6 sees 3..6: head 0 holds 0,1,2 hidden (3 of them), head 1 holds 1,2 hidden (2)
    assert layer.expire() == 2
    held = [sorted(layer.positions[0, h].tolist()) for h in range(2)]
    assert held == [[2, 3, 5], [3, 4, 5]]
