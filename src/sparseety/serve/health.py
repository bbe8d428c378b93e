"""Extraction health of a traced request: do the layers agree on which tokens mattered?"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from sparseety.config import ExtractionConfig
from sparseety.engine.importance import important_tokens
from sparseety.engine.result import RunResult


@dataclass(frozen=True)
class ExtractionHealth:
    """Agreement of per-layer important-token rankings for one request.

    Attributes
    ----------
    top1_hit_rate : share of layers whose most important token is the most important token over all
        layers (the ranking of the summed importance).
    adjacent_overlap : ``{layer: |top_k(layer) ∩ top_k(layer + 1)| / k}`` for each adjacent pair.
    filtered_ratio : share of (layer, position) scores, max-normalized per layer, below ``min_score``
        (special tokens left out).
    extraction_s : seconds the extraction of the rankings took.
    """

    top1_hit_rate: float
    adjacent_overlap: dict[int, float]
    filtered_ratio: float
    extraction_s: float


def extraction_health(result: RunResult, special_ids: tuple[int, ...], top_k: int,
                      min_score: float = ExtractionConfig().min_score) -> ExtractionHealth | None:
    """Extract the rankings of a tier >= 2 ``result`` again, timed, and measure their agreement.

    Parameters
    ----------
    result : a run with ``arrays["importance"]`` ``[layers, positions]``; None is returned without it.
    special_ids : token ids left out of rankings and of the filtered ratio (attention sinks).
    top_k : records per ranking.
    min_score : threshold of the filtered ratio, on scores divided by their layer's largest score.
    """
    importance = result.arrays.get("importance")
    if importance is None or importance.ndim != 2 or importance.shape[1] == 0:
        return None
    scores = np.nan_to_num(importance.astype(np.float32))
    token_ids = np.asarray(result.token_ids[: scores.shape[1]], dtype=np.int64)
    start = time.perf_counter()
    records = important_tokens(token_ids, torch.from_numpy(scores), len(result.prompt_ids), top_k, None, special_ids)
    extraction_s = time.perf_counter() - start

    overall = [r.position for r in records if r.layer is None]
    per_layer: dict[int, list[int]] = {}
    for r in records:
        if r.layer is not None:
            per_layer.setdefault(r.layer, []).append(r.position)
    layers = sorted(per_layer)
    hits = [per_layer[layer][0] == overall[0] for layer in layers] if overall else []
    overlap = {
        layer: len(set(per_layer[layer]) & set(per_layer[layer + 1])) / max(len(per_layer[layer]), 1)
        for layer in layers if layer + 1 in per_layer
    }
    keep = ~np.isin(token_ids, np.asarray(special_ids, dtype=np.int64))
    considered = scores[:, keep]
    peak = considered.max(axis=1, keepdims=True) if considered.size else np.zeros((scores.shape[0], 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        normalized = np.where(peak > 0, considered / np.where(peak > 0, peak, 1), 0.0)
    filtered = float((normalized < min_score).mean()) if normalized.size else 0.0
    return ExtractionHealth(
        top1_hit_rate=float(np.mean(hits)) if hits else 0.0,
        adjacent_overlap=overlap,
        filtered_ratio=filtered,
        extraction_s=extraction_s,
    )
