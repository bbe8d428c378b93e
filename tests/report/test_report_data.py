"""View data: ranks, per-layer summaries, MoE load, drafts, pruning, passkey/tune views, and bad input."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from sparseety.errors import ConfigError, RecordError
from sparseety.report.bench_data import bench_view
from sparseety.report.data import (
    drafts_per_step,
    moe_load,
    pruning_per_layer,
    ranks,
    trace_view,
)
from sparseety.report.sources import load_source
from sparseety.store import StoredTrace


def test_ranks_order_by_score_then_position_with_unscored_last():
    values = np.array([[0.5, 0.9, 0.5, np.nan, 0.1]], dtype=np.float16)
    expected_order = sorted(range(5), key=lambda p: (np.isnan(values[0, p]), -np.nan_to_num(values[0, p]), p))
    got = ranks(values)[0]
    assert [int(np.flatnonzero(got == r)[0]) for r in range(5)] == expected_order == [1, 0, 2, 4, 3]


def test_trace_view_of_a_real_run(real_trace):
    view = trace_view(real_trace, layer=4)
    doc, arrays = real_trace.document, real_trace.arrays
    n = len(doc["prompt_token_ids"]) + len(doc["output_token_ids"])
    assert view["positions"] == n and view["prompt_len"] == len(doc["prompt_token_ids"])
    assert view["layers"] == 30 and view["kv_heads"] == 3 and view["layer"] == 4
    assert view["tokens"]["text"] == doc["token_texts"]
    importance = arrays["importance"].astype(np.float32)
    np.testing.assert_array_equal(view["importance"][5, : importance.shape[1]], importance[4].astype(np.float16))
    np.testing.assert_allclose(view["importance"][0, : importance.shape[1]].astype(np.float32),
                               importance.sum(axis=0), rtol=2e-3)
    assert np.isnan(view["importance"][1:, importance.shape[1]:].astype(np.float32)).all()  # the last token
    seen = n - 1
    kept = doc["sparsity"]["kept_positions_final"]
    assert view["kept_fraction"] == pytest.approx(
        [np.mean([len(p) for p in kept[str(layer)].values()]) / seen for layer in range(30)])
    assert view["evicts"] and view["compare"] is None and view["moe"] is None


def test_moe_load_is_mean_probability_and_top1_share():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.4, 0.1], [0.2, 0.2, 0.6]], dtype=np.float16)
    load = moe_load({"router.2": probs, "router.0": probs[:2], "evicted.step": np.zeros(0)})
    assert load["layers"] == [0, 2] and load["experts"] == 3 and load["tokens"] == [2, 4]
    assert load["top1_share"] == [[0.5, 0.5, 0.0], [0.5, 0.25, 0.25]]
    np.testing.assert_allclose(load["mean_prob"][1], probs.astype(np.float32).mean(axis=0), atol=1e-4)
    assert moe_load({}) is None


def test_drafts_from_per_forward_rows_and_from_per_token_rows():
    rows = {"draft.step": np.array([3, 5, 3]), "draft.proposed": np.array([2, 3, 1]),
            "draft.rejected": np.array([1, 3, 0])}
    assert drafts_per_step(rows) == {"step": [3, 5], "proposed": [3, 3], "accepted": [2, 0], "rejected": [1, 3]}
    tokens = {"drafted.step": np.array([2, 2, 2, 7]), "drafted.rejected": np.array([0, 0, 1, 1])}
    assert drafts_per_step(tokens) == {"step": [2, 7], "proposed": [3, 1], "accepted": [2, 0], "rejected": [1, 1]}
    assert drafts_per_step({}) is None


def test_pruning_rows_leave_from_the_next_layer_on():
    arrays = {"pruned.layer": np.array([0, 0, 1, 1, 1]), "pruned.kv_head": np.array([-1, -1, 0, 1, 1]),
              "pruned.position": np.array([3, 4, 5, 5, 6]), "pruned.step": np.zeros(5, dtype=np.int64)}
    view = pruning_per_layer(arrays, num_layers=3, prompt_len=10)
    # layer 0 computes all 10; layer 1 lost 3 and 4; layer 2 also lost 5 (both heads) and 6 (head 1): mean 3.5
    assert view["remaining"] == [10.0, 8.0, 6.5] and view["pruned"] == [0.0, 2.0, 3.5] and view["total"] == 10
    counted = pruning_per_layer({**arrays, "layer_tokens": np.array([10, 8, 6])}, num_layers=3, prompt_len=10)
    assert counted["remaining"] == [10.0, 8.0, 6.0]
    assert pruning_per_layer({}, 3, 10) is None
    assert pruning_per_layer({"layer_tokens": np.array([10, 10, 10])}, 3, 10) is None


def test_real_moe_run_with_drafts(moe_trace):
    view = trace_view(moe_trace)
    router = sorted(n for n in moe_trace.arrays if n.startswith("router."))
    assert view["moe"]["layers"] == [int(n.split(".")[1]) for n in router] and view["moe"]["experts"] == 4
    for row in view["moe"]["top1_share"]:
        assert sum(row) == pytest.approx(1.0, abs=1e-3)
    drafts = view["drafts"]
    assert drafts is not None
    assert sum(drafts["rejected"]) == moe_trace.document["sparsity"]["draft_rejected"]
    assert sum(drafts["proposed"]) == moe_trace.document["sparsity"]["draft_tokens"]


def test_layer_that_does_not_exist(real_trace):
    with pytest.raises(ConfigError, match=r"--layer 30 does not exist: the trace has layers 0\.\.29"):
        trace_view(real_trace, layer=30)
    with pytest.raises(ConfigError, match="--layer -1 does not exist"):
        trace_view(real_trace, layer=-1)


@pytest.mark.parametrize(("version", "age"), [("0.4", "older"), ("2.0", "newer")])
def test_other_major_schema_is_refused(real_trace, version, age):
    document = copy.deepcopy(real_trace.document)
    document["provenance"]["schema_version"] = version
    other = StoredTrace(document=document, arrays=real_trace.arrays, path=real_trace.path)
    with pytest.raises(RecordError, match=f"schema version {version}, an {age} major version"):
        load_source(other)


def test_a_json_file_that_is_not_a_report_source(tmp_path: Path):
    bad = tmp_path / "x.json"
    bad.write_text('{"kind": "something"}')
    with pytest.raises(RecordError):
        load_source(bad)
    broken = tmp_path / "y.json"
    broken.write_text("{not json")
    with pytest.raises(RecordError, match="y.json is not a trace or a passkey/tune JSON file"):
        load_source(broken)


def test_passkey_view_sorts_columns_numerically_and_fills_gaps():
    view = bench_view({"kind": "passkey", "results": [{}, {}, {}],
                       "accuracy": {"h2o": {"0.5": 0.75, "0.25": 1.0, "0.75": 0.5}, "dense": {"0.25": 1.0}},
                       "by_depth": {"h2o": {"10": 1.0, "2": 0.5}}, "model": "smollm2-135m"})
    assert view["accuracy"] == {"rows": ["h2o", "dense"], "columns": ["0.25", "0.5", "0.75"],
                                "values": [[1.0, 0.75, 0.5], [1.0, None, None]]}
    assert view["by_depth"]["columns"] == ["2", "10"] and view["results"] == 3
    assert view["extra"] == {"model": "smollm2-135m"}


def test_tune_view_sorts_the_curve_and_rejects_a_bad_one():
    view = bench_view({"kind": "tune", "policy": "h2o", "metric": "rouge_l", "threshold": 0.9,
                       "curve": [{"budget": 64, "ratio": 0.5, "value": 0.95, "meets": True},
                                 {"budget": 16, "ratio": 0.9, "value": 0.4, "meets": False}],
                       "answer": {"budget": 64}})
    assert [p["budget"] for p in view["curve"]] == [16, 64] and view["threshold"] == 0.9
    with pytest.raises(RecordError, match="'curve' must be a list"):
        bench_view({"kind": "tune", "curve": [{"value": 1}]})


def test_pruning_of_a_real_tiny_run_matches_the_engines_layer_counts():
    """Rebuilt from the pruned rows alone, the per-layer counts equal what the engine counted."""
    import torch
    from tiny_models import build_model, build_tokenizer, prompt_ids

    from sparseety.engine import SparseEngine
    from sparseety.engine.inputs import EncodedInput
    from sparseety.policies import build_policy
    from sparseety.prune_schedule import PruneSchedule

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = SparseEngine(build_model("llama"), build_tokenizer(), "tiny-llama")
        result = engine.generate(EncodedInput(prompt_ids(40)), build_policy("dense", None, {}), max_new_tokens=3,
                                 tier=2, prune=PruneSchedule(points=((0, 0.25), (2, 0.5))))
    finally:
        torch.set_num_threads(threads)
    arrays = result.arrays
    assert len(arrays["pruned.layer"]) and "layer_tokens" in arrays
    rebuilt = pruning_per_layer({k: v for k, v in arrays.items() if k != "layer_tokens"}, 4, 40)
    counted = pruning_per_layer(arrays, 4, 40)
    assert rebuilt == counted
    assert counted["remaining"][0] == 40 and counted["remaining"][-1] < counted["remaining"][1] < 40
