"""The report's MoE and sliding-window sections from their sources: vLLM's per-request routed counts,
``router.N`` probabilities (either engine), and the frees of vLLM's windowed KV-cache groups."""

from __future__ import annotations

import numpy as np

from sparseety.report.routing_window import important_routing, moe_load, window_frees


def test_window_frees_accumulate_over_steps_and_per_group():
    document = {"vllm": {"window": {"layers": {"0": 4, "2": 4}, "freed_blocks": 6, "freed_bytes": 6000,
                                    "frees": [[3, 1, 1, 1000], [0, 1, 2, 2000], [3, 2, 1, 1000], [9, 1, 2, 2000]]}}}
    frees = window_frees(document, steps=5)
    assert frees["steps"] == [0, 1, 2, 3, 4]
    assert frees["bytes"] == [2000, 2000, 2000, 4000, 6000]  # the free past the last step counts at the last
    assert frees["groups"] == [{"group": 1, "blocks": 5, "bytes": 5000}, {"group": 2, "blocks": 1, "bytes": 1000}]
    assert frees["windows"] == {"0": 4, "2": 4} and frees["freed_blocks"] == 6 and frees["freed_bytes"] == 6000
    assert window_frees({"vllm": {"window": {"layers": {"0": 4}, "frees": []}}}, 5) is None
    assert window_frees({}, 5) is None


def test_moe_load_from_vllms_counts_and_from_router_probabilities():
    counted = {"vllm": {"moe": {"layers": [0, 2], "experts": 3, "tokens": [4, 4],
                                "expert_tokens": [[6, 2, 0], [2, 2, 4]]}}}
    only_counts = moe_load({}, counted)
    assert only_counts["grids"] == ["routed_share"] and only_counts["layers"] == [0, 2]
    assert only_counts["routed_share"] == [[0.75, 0.25, 0.0], [0.25, 0.25, 0.5]]
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [np.nan, np.nan, np.nan], [0.2, 0.2, 0.6]], dtype=np.float16)
    both = moe_load({"router.0": probs, "router.2": probs}, counted)
    assert both["grids"] == ["routed_share", "top1_share", "mean_prob"]
    assert both["top1_share"][0] == [round(1 / 3, 4), round(1 / 3, 4), round(1 / 3, 4)]  # the NaN row is left out
    assert both["tokens"] == [4, 4]  # vLLM's count of routed tokens, not the probability rows
    assert set(both["labels"]) == set(both["grids"])
    other_layers = moe_load({"router.1": probs}, counted)  # probabilities of other layers than the counts: not mixed
    assert other_layers["grids"] == ["routed_share"]


def test_important_routing_names_each_ranked_tokens_first_expert_per_layer():
    probs0 = np.array([[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]], dtype=np.float16)
    probs1 = np.array([[0.1, 0.9], [np.nan, np.nan], [0.6, 0.4]], dtype=np.float16)
    top = [{"rank": 1, "position": 0, "text": "a", "layer": None}, {"rank": 0, "position": 1, "text": "b", "layer": None},
           {"rank": 0, "position": 2, "text": "c", "layer": 0}]
    routing = important_routing({"router.0": probs0, "router.1": probs1}, top)
    assert routing["layers"] == [0, 1]
    assert routing["tokens"] == [{"rank": 0, "position": 1, "text": "b"}, {"rank": 1, "position": 0, "text": "a"}]
    assert routing["experts"] == [[1, -1], [0, 1]]
    assert important_routing({}, top) is None and important_routing({"router.0": probs0}, []) is None
