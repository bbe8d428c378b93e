"""Ranked important tokens of a run, through the extractor (one ranking per layer, plus one over all layers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from sparseety.config import ExtractionConfig
from sparseety.extract import extract
from sparseety.schema import TokenRecord


def important_tokens(token_ids: np.ndarray, importance: torch.Tensor, prompt_len: int, top_k: int,
                     decode: Callable[[int], str] | None, special_ids: tuple[int, ...] = (),
                     layers: Sequence[int] | None = None, min_score: float = 0.0,
                     sinks: Sequence[int] = ()) -> list[TokenRecord]:
    """Rank the tokens the model attended to while generating.

    Parameters
    ----------
    token_ids : ``[seen]`` ids of the positions the cache saw.
    importance : ``[layers, seen]`` attention each position received from the queries that produced
        the output tokens, summed over those steps and averaged over heads.
    prompt_len : tokens before the first generated one.
    top_k : records per ranking.
    special_ids : token ids left out of the rankings (BOS and chat-template markers act as attention
        sinks and would otherwise top every ranking; their mass stays in the trace's importance array).
    layers : layers that recorded importance (the others hold zeros and get no ranking); None: all.
    min_score : records scoring below this (scores are divided by each ranking's maximum) are dropped.
    sinks : positions left out of the rankings (attention sinks; their mass stays in the trace too).

    Returns
    -------
    The ranking over all layers (``layer`` None) first, then one ranking per layer.
    """
    config = ExtractionConfig(score_type="attention", layout="qk", top_k=top_k, min_score=min_score, normalize="max",
                              exclude_special=bool(special_ids), special_ids=tuple(special_ids),
                              exclude_positions=tuple(int(p) for p in sinks))
    ids = torch.as_tensor(token_ids)
    records = extract(ids, importance.sum(dim=0, keepdim=True), config, decode, prompt_len=prompt_len)
    for layer in range(importance.shape[0]) if layers is None else layers:
        records += extract(ids, importance[layer : layer + 1], config, decode, prompt_len=prompt_len, layer=layer)
    return records
