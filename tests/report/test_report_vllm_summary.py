"""The summary of a trace vLLM served reads like an own-engine one: cached prompt tokens labelled as cached
(not as skipped attention), KV bytes "not reported" rather than 0.00 MiB when vLLM did not report them, and
the ids-only note only for traces stored ids-only."""

from __future__ import annotations

from sparseety.report.data import summary


def _rows(document: dict) -> dict:
    return {label: value for _, rows in summary(document) for label, value in rows}


def _document(engine: str | None, peak: int | None, cached: int | None) -> dict:
    usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"request_id": "r", "model": "smollm2-135m", "tier": 2, "usage": usage,
            "provenance": {"engine": engine} if engine else {},
            "sparsity": {"policy": "vllm" if engine else "h2o", "skipped_events": None if engine else 5,
                         "kv_cache_bytes_peak": peak, "kv_cache_bytes_dense": peak, "draft_tokens": 4,
                         "draft_rejected": 1},
            "timings": {}}


def test_vllm_summary_labels_cached_tokens_and_unreported_kv():
    rows = _rows(_document("vllm", None, 64))
    assert rows["KV cache peak"] == "not reported"
    assert rows["cached prompt tokens (prefix cache)"] == 64
    assert "skipped (top-k, window)" not in rows
    assert rows["drafts (rejected)"] == "4 (1)"
    rows = _rows(_document("vllm", 3 * 2**20, 0))
    assert rows["KV cache peak"] == "3.00 MiB of 3.00 MiB dense (100.0%)"


def test_own_engine_summary_is_unchanged():
    rows = _rows(_document(None, 2**20, None))
    assert rows["skipped (top-k, window)"] == 5 and "cached prompt tokens (prefix cache)" not in rows
    assert rows["KV cache peak"] == "1.00 MiB of 1.00 MiB dense (100.0%)"


def test_vllm_summary_of_a_windowed_model_counts_what_the_windows_hid_and_freed():
    document = _document("vllm", 3 * 2**20, 0)
    document["sparsity"].update(skipped_events=120, kv_cache_bytes_dense=4 * 2**20)
    document["vllm"] = {"window": {"freed_blocks": 5, "freed_bytes": 2**20, "frees": [[2, 0, 5, 2**20]]}}
    rows = _rows(document)
    assert rows["skipped (sliding window)"] == 120 and "skipped (top-k, window)" not in rows
    assert rows["KV cache peak"] == "3.00 MiB of 4.00 MiB dense (75.0%); sliding windows freed 1.00 MiB (5 blocks)"
