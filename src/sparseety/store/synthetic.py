"""Synthetic :class:`RunResult` objects shaped like real runs, for load tests and the store benchmark.

No model runs: ids, events and vectors are random but consistent (event token ids match positions,
importance covers every position), so everything the store writes can be checked on read.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import numpy as np

from sparseety.schema import SCHEMA_VERSION, TokenRecord

if TYPE_CHECKING:
    from sparseety.engine.result import RunResult


def synthetic_result(
    index: int,
    *,
    tier: int = 2,
    prompt_len: int = 24,
    new_tokens: int = 4,
    layers: int = 2,
    kv_heads: int = 2,
    events_per_step: int = 1,
    top_k: int = 2,
    experts: int = 0,
    text: str | None = None,
    seed: int = 0,
) -> RunResult:
    """Request number ``index`` of a synthetic stream (deterministic in ``index`` and ``seed``).

    Each decode step evicts ``events_per_step`` positions per layer and KV head; tier 2 adds
    ``importance`` ``[layers, positions]`` and ``top_k`` important tokens per layer; tier 3 adds
    ``step_importance`` ``[steps, layers, positions]``; ``experts`` > 0 adds ``router.<layer>``.
    """
    from sparseety.engine.result import RunResult

    rng = np.random.default_rng([seed, index])
    total = prompt_len + new_tokens
    ids = rng.integers(10, 1000, total)
    seen = total - 1
    steps = np.arange(1, new_tokens)
    n = len(steps) * layers * kv_heads * events_per_step
    position = rng.integers(0, prompt_len, n)
    arrays: dict[str, np.ndarray] = {}
    if tier >= 1 and n:
        arrays.update(_eviction_arrays(rng, ids, position, steps, layers, kv_heads, events_per_step))
    records: list[TokenRecord] = []
    texts: list[str] = []
    if tier >= 2:
        importance = rng.random((layers, seen)).astype(np.float16)
        arrays["importance"] = importance
        records = _important_records(importance, ids, prompt_len, top_k)
        texts = [f" w{int(i)}" for i in ids]
        arrays.update(_router_arrays(rng, seen, layers, experts))
    if tier >= 3:
        arrays["step_importance"] = rng.random((new_tokens, layers, seen)).astype(np.float16)
    return RunResult(
        request_id=uuid.UUID(int=int(rng.integers(0, 2**62)) << 64 | index).hex,
        model="synthetic",
        text=text if text is not None else "".join(texts[prompt_len:]),
        prompt_ids=ids[:prompt_len].tolist(),
        output_ids=ids[prompt_len:].tolist(),
        policy="h2o",
        params={"recent": 4},
        budget=prompt_len // 2,
        tier=tier,
        evicted_positions=len(np.unique(position)) if n else 0,
        eviction_events=n,
        skipped_events=0,
        kept_positions_final={str(layer): {str(h): [0, 1] for h in range(kv_heads)} for layer in range(layers)}
        if tier >= 2 else None,
        kv_cache_bytes_peak=1024,
        kv_cache_bytes_dense=2048,
        draft_tokens=0,
        draft_rejected=0,
        prefill_s=0.01,
        decode_s=0.02,
        important_tokens=records,
        token_texts=texts,
        provenance={"schema_version": SCHEMA_VERSION, "model": "synthetic", "policy": "h2o", "tier": tier,
                    "extraction": {"score_type": "attention", "top_k": top_k}},
        arrays=arrays,
    )


def _eviction_arrays(rng: np.random.Generator, ids: np.ndarray, position: np.ndarray, steps: np.ndarray,
                     layers: int, kv_heads: int, events_per_step: int) -> dict[str, np.ndarray]:
    """The ``evicted.*`` event group: ``events_per_step`` events per decode step, layer and KV head, in that
    order; each array ``(len(steps) * layers * kv_heads * events_per_step,)``."""
    n = len(position)
    return {
        "evicted.step": np.repeat(steps, layers * kv_heads * events_per_step).astype(np.int64),
        "evicted.layer": np.tile(np.repeat(np.arange(layers), kv_heads * events_per_step), len(steps)).astype(np.int64),
        "evicted.kv_head": np.tile(np.repeat(np.arange(kv_heads), events_per_step), len(steps) * layers).astype(np.int64),
        "evicted.position": position.astype(np.int64),
        "evicted.token_id": ids[position].astype(np.int64),
        "evicted.score": rng.random(n).astype(np.float32),
    }


def _important_records(importance: np.ndarray, ids: np.ndarray, prompt_len: int, top_k: int) -> list[TokenRecord]:
    """The ``top_k`` most important positions of each layer of ``importance`` ``[layers, positions]``."""
    records: list[TokenRecord] = []
    for layer in range(importance.shape[0]):
        best = np.argsort(-importance[layer].astype(np.float32), kind="stable")[:top_k]
        for rank, pos in enumerate(best):
            records.append(TokenRecord(
                token_id=int(ids[pos]), position=int(pos), score=float(importance[layer, pos]), layer=layer,
                step=None, head=None, rank=rank, token_type="prompt" if pos < prompt_len else "generated",
                text=f" w{int(ids[pos])}"))
    return records


def _router_arrays(rng: np.random.Generator, seen: int, layers: int, experts: int) -> dict[str, np.ndarray]:
    """``router.<layer>`` ``[positions, experts]`` float16 rows that sum to 1; none when ``experts`` is 0."""
    arrays: dict[str, np.ndarray] = {}
    for layer in range(experts and layers):
        probs = rng.random((seen, experts)).astype(np.float32)
        arrays[f"router.{layer}"] = (probs / probs.sum(1, keepdims=True)).astype(np.float16)
    return arrays
