"""write_trace -> load_trace gives back the run: document fields and every array, for real runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_models import prompt_ids, repetitive_ids

from sparseety.engine import EncodedInput, encode_prompt
from sparseety.policies import build_policy
from sparseety.store import connect, load_trace, should_sample, write_trace
from sparseety.store.synthetic import synthetic_result


def assert_round_trip(result, trace) -> None:
    """Every array (name, dtype, shape, values) and every document field the readers use."""
    assert set(trace.arrays) == set(result.arrays)
    for name, array in result.arrays.items():
        back = trace.arrays[name]
        assert back.dtype == array.dtype, name
        assert back.shape == array.shape, name
        assert np.array_equal(back, array, equal_nan=True), name
    doc, expected = trace.document, result.to_json()
    for key in ("request_id", "model", "tier", "text", "output_token_ids", "usage", "sparsity", "important_tokens"):
        assert doc[key] == expected[key], key
    assert doc["timings"]["prefill_s"] == expected["timings"]["prefill_s"]
    assert doc["prompt_token_ids"] == result.prompt_ids
    assert doc["token_texts"] == result.token_texts
    assert doc["provenance"] == json.loads(json.dumps(result.provenance))
    assert trace.request_id == result.request_id and trace.tier == result.tier


def test_tiny_llama_tier3_with_evictions(tiny_engine, one_torch_thread, tmp_path: Path):
    result = tiny_engine("llama").generate(EncodedInput(prompt_ids(20)), build_policy("h2o", 8), max_new_tokens=6, tier=3)
    assert {"evicted.position", "importance", "step_importance"} <= set(result.arrays)
    path = write_trace(result, tmp_path)
    assert_round_trip(result, load_trace(path))
    assert_round_trip(result, load_trace(tmp_path, result.request_id))


def test_tiny_llama_topk_attention_events(tiny_engine, one_torch_thread, tmp_path: Path):
    result = tiny_engine("llama").generate(EncodedInput(prompt_ids(16)), build_policy("topk_attention", 6),
                                           max_new_tokens=4, tier=3)
    assert {"attended.position", "skipped.position"} <= set(result.arrays)
    write_trace(result, tmp_path)
    assert_round_trip(result, load_trace(tmp_path))
    con = connect(tmp_path)
    counts = dict(con.sql("SELECT event, count(*) FROM token_events GROUP BY event").fetchall())
    assert counts == {"attended": len(result.arrays["attended.position"]), "skipped": len(result.arrays["skipped.position"])}


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_moe_router_arrays(family, tiny_engine, one_torch_thread, tmp_path: Path):
    result = tiny_engine(family).generate(EncodedInput(prompt_ids(12)), build_policy("dense"), max_new_tokens=4, tier=3)
    routers = sorted(n for n in result.arrays if n.startswith("router."))
    assert routers, "the MoE run recorded no router probabilities"
    write_trace(result, tmp_path)
    assert_round_trip(result, load_trace(tmp_path))
    rows = connect(tmp_path).sql(
        "SELECT layer, count(*), max(len(values)) FROM signals WHERE kind = 'router' GROUP BY layer ORDER BY layer"
    ).fetchall()
    assert rows == [(int(n.split(".")[1]), *result.arrays[n].shape) for n in routers]


def test_speculative_draft_arrays(tiny_engine, one_torch_thread, tmp_path: Path):
    result = tiny_engine("llama").generate(EncodedInput(repetitive_ids(24)), build_policy("dense"), max_new_tokens=8,
                                           tier=2, speculative=3)
    drafted = {n for n in result.arrays if n.startswith("drafted.")}
    assert drafted and len(result.arrays["drafted.position"]) > 0
    write_trace(result, tmp_path)
    assert_round_trip(result, load_trace(tmp_path))
    counts = dict(connect(tmp_path).sql("SELECT event, count(*) FROM token_events GROUP BY event").fetchall())
    rejected = int(result.arrays["drafted.rejected"].sum())
    assert counts.get("draft_rejected", 0) == rejected
    assert counts.get("draft_accepted", 0) == len(result.arrays["drafted.rejected"]) - rejected


def test_default_model_tier3(smollm_engine, tmp_path: Path):
    encoded = encode_prompt(smollm_engine.tokenizer, "List two fruits.", True)
    result = smollm_engine.generate(encoded, build_policy("streaming", 16, {"sinks": 2}), max_new_tokens=6, tier=3)
    write_trace(result, tmp_path, extra={"compare": {"match_rate": 0.5, "policy": "streaming"}})
    trace = load_trace(tmp_path, result.request_id)
    assert_round_trip(result, trace)
    assert trace.document["compare"] == {"match_rate": 0.5, "policy": "streaming"}
    assert trace.arrays["importance"].shape == (30, len(result.prompt_ids) + 5)
    con = connect(tmp_path)
    (n_events,) = con.sql("SELECT count(*) FROM token_events WHERE event = 'evicted'").fetchall()[0]
    assert n_events == result.eviction_events
    (layers,) = con.sql("SELECT count(*) FROM signals WHERE kind = 'importance'").fetchall()[0]
    assert layers == 30


def test_unsampled_requests_keep_tier1_and_forced_keep_everything(tmp_path: Path):
    results = [synthetic_result(i, tier=2) for i in range(40)]
    for result in results:
        write_trace(result, tmp_path, sample_rate=0.5)
    forced = synthetic_result(99, tier=3)
    write_trace(forced, tmp_path, sample_rate=0.0)
    con = connect(tmp_path)
    tiers = dict(con.sql("SELECT request_id, tier FROM requests").fetchall())
    for result in results:
        assert tiers[result.request_id] == (2 if should_sample(result.request_id, 0.5) else 1)
    assert tiers[forced.request_id] == 3
    unsampled = next(r for r in results if not should_sample(r.request_id, 0.5))
    trace = load_trace(tmp_path, unsampled.request_id)
    assert trace.arrays == {} and trace.document["important_tokens"] == []
    assert trace.document["prompt_token_ids"] == [] and trace.document["text"] is None
    assert trace.document["usage"]["prompt_tokens"] == len(unsampled.prompt_ids)
    assert trace.document["sparsity"]["eviction_events"] == unsampled.eviction_events
    (events,) = con.sql("SELECT count(*) FROM token_events WHERE request_id = ?", params=[unsampled.request_id]).fetchall()[0]
    assert events == 0
    assert_round_trip(forced, load_trace(tmp_path, forced.request_id))


def test_stored_trace_renders_in_notebooks(tiny_engine, one_torch_thread, tmp_path: Path):
    """A StoredTrace read back from the dataset is what the report renders inline (``report.show``, Jupyter's
    ``_repr_html_``); the store itself draws nothing (it never imports the report)."""
    from sparseety.report import show

    result = tiny_engine("llama").generate(EncodedInput(prompt_ids(10)), build_policy("h2o", 6), max_new_tokens=3, tier=2)
    write_trace(result, tmp_path)
    html = show(load_trace(tmp_path))._repr_html_()
    assert html.lstrip().lower().startswith("<!doctype html") or "<div" in html
    assert result.request_id in html
