"""A large synthetic :class:`StoredTrace` shaped like a real H2O run, for report tests and the report benchmark.

No model runs. Sinks and a recent window are always kept, the rest of the prompt is evicted at
prefill down to the budget (a different random choice per layer and KV head), and each decode step
evicts one more position per layer and KV head, as H2O does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparseety.schema import SCHEMA_VERSION
from sparseety.store import StoredTrace


def synthetic_trace(*, prompt_len: int = 8128, new_tokens: int = 64, layers: int = 30, kv_heads: int = 3,
                    budget: int = 1024, sinks: int = 4, window: int = 256, seed: int = 0) -> StoredTrace:
    """A tier-3 trace of ``prompt_len + new_tokens`` positions over ``layers`` layers.

    Arrays: ``evicted.*`` (prefill plus one eviction per decode step, layer and KV head),
    ``importance`` ``[layers, seen]``, ``step_importance`` ``[new_tokens, layers, seen]`` (NaN past
    each step's length), ``activation.*``; the document has token texts (one of them ``<script>``),
    ``kept_positions_final`` and 16 important tokens per layer plus the all-layers ranking.
    """
    rng = np.random.default_rng(seed)
    total = prompt_len + new_tokens
    seen = total - 1
    ids = rng.integers(100, 49000, total)
    texts = [f" w{int(t)}" for t in ids]
    texts[5] = "<script>alert(1)</script>"
    kept: dict[str, dict[str, list[int]]] = {}
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("step", "layer", "kv_head", "position")}

    def add(step: int, layer: int, head: int, positions: np.ndarray) -> None:
        columns["step"].append(np.full(positions.size, step))
        columns["layer"].append(np.full(positions.size, layer))
        columns["kv_head"].append(np.full(positions.size, head))
        columns["position"].append(positions)

    for layer in range(layers):
        kept[str(layer)] = {}
        for head in range(kv_heads):
            middle = np.arange(sinks, prompt_len - window)
            held = rng.choice(middle, size=max(0, budget - sinks - window), replace=False)
            slots = set(range(sinks)) | set(held.tolist()) | set(range(prompt_len - window, prompt_len))
            add(0, layer, head, np.setdiff1d(middle, held))
            for step in range(1, new_tokens):
                slots.add(prompt_len + step - 1)
                candidates = sorted(slots - set(range(sinks)) - set(range(prompt_len + step - window, total)))
                gone = int(rng.choice(candidates))
                slots.discard(gone)
                add(step, layer, head, np.array([gone]))
            kept[str(layer)][str(head)] = sorted(slots)
    arrays: dict[str, np.ndarray] = {f"evicted.{k}": np.concatenate(v).astype(np.int64) for k, v in columns.items()}
    arrays["evicted.token_id"] = ids[arrays["evicted.position"]].astype(np.int64)
    arrays["evicted.score"] = rng.random(arrays["evicted.step"].size).astype(np.float32)
    importance = rng.exponential(1.0, (layers, seen)).astype(np.float32)
    importance[:, :sinks] *= 40
    arrays["importance"] = importance.astype(np.float16)
    steps = rng.exponential(0.01, (new_tokens, layers, seen)).astype(np.float16)
    for step in range(new_tokens):
        steps[step, :, prompt_len + step:] = np.nan
    arrays["step_importance"] = steps
    arrays["activation.maxabs"] = rng.gamma(2.0, 2.0, (layers, seen)).astype(np.float16)
    arrays["activation.zero_frac"] = rng.random((layers, seen)).astype(np.float16)
    records = []
    for layer in [None, *range(layers)]:
        row = importance.sum(axis=0) if layer is None else importance[layer]
        for rank, pos in enumerate(np.lexsort((np.arange(seen), -row))[:16]):
            records.append({"token_id": int(ids[pos]), "position": int(pos), "score": float(row[pos] / row.max()),
                            "layer": layer, "step": None, "head": None, "rank": rank,
                            "token_type": "prompt" if pos < prompt_len else "generated", "text": texts[pos]})
    document = {
        "request_id": f"synthetic{seed:023d}",
        "model": "synthetic",
        "tier": 3,
        "text": "".join(texts[prompt_len:]),
        "output_token_ids": ids[prompt_len:].tolist(),
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": new_tokens, "total_tokens": total},
        "sparsity": {"policy": "h2o", "params": {"recent_ratio": 0.25}, "budget": budget,
                     "evicted_positions": int(np.unique(arrays["evicted.position"]).size),
                     "eviction_events": int(arrays["evicted.step"].size), "skipped_events": 0,
                     "kept_positions_final": kept, "kv_cache_bytes_peak": budget * layers * kv_heads * 2 * 64 * 4,
                     "kv_cache_bytes_dense": seen * layers * kv_heads * 2 * 64 * 4, "draft_tokens": 0,
                     "draft_rejected": 0},
        "important_tokens": records,
        "timings": {"prefill_s": 12.0, "decode_s": 9.0, "decode_tokens_per_s": 7.0},
        "prompt_token_ids": ids[:prompt_len].tolist(),
        "token_texts": texts,
        "provenance": {"schema_version": SCHEMA_VERSION, "model": "synthetic", "policy": "h2o", "tier": 3},
    }
    return StoredTrace(document=document, arrays=arrays, path=Path("synthetic"))
