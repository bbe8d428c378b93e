"""Replay: the stored tier-3 signals of a request as extractor inputs, one per layer.

``attention``: ``step_importance[:, layer, :]`` as a ``qk`` signal ``[forwards, positions]`` (the
attention each forward's newest query gave every key, heads averaged; keys not yet present score 0).
``route``: ``router.<layer>`` ``[tokens_fed, experts]``. ``activation``: ``activation.maxabs``
of the layer as ``[tokens_fed, 1]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from sparseety.errors import RecordError
from sparseety.store.reader import StoredTrace

_ROUTER = re.compile(r"^router\.(\d+)$")


@dataclass(frozen=True)
class ReplayInput:
    """One signal to extract from: ``scores`` over ``token_ids`` (prompt first, ``prompt_len`` of them)."""

    generation_id: str
    token_ids: list[int]
    prompt_len: int
    layer: int
    score_type: str
    scores: np.ndarray
    layout: str | None


def replay_inputs(trace: StoredTrace, score_type: str = "attention", layer: int | None = None) -> list[ReplayInput]:
    """The request's stored signals of ``score_type`` (every layer, or ``layer``).

    Raises
    ------
    RecordError
        The request was stored below tier 3, has no signal of that type, or no such layer.
    """
    doc = trace.document
    if trace.tier < 3:
        raise RecordError(
            f"request {trace.request_id} was stored at tier {trace.tier}; replay needs tier-3 signals "
            f"(run it with --tier 3 or --force-trace)"
        )
    ids = list(doc.get("prompt_token_ids") or []) + list(doc.get("output_token_ids") or [])
    prompt_len = len(doc.get("prompt_token_ids") or [])
    by_layer: dict[int, tuple[np.ndarray, str | None]] = {}
    if score_type == "attention":
        steps = trace.arrays.get("step_importance")
        if steps is None or steps.ndim != 3:
            raise RecordError(f"request {trace.request_id} has no stored step_importance signal")
        for index in range(steps.shape[1]):
            by_layer[index] = (np.nan_to_num(steps[:, index, :].astype(np.float32), nan=0.0), "qk")
    elif score_type == "route":
        for name, array in trace.arrays.items():
            match = _ROUTER.match(name)
            if match:
                by_layer[int(match.group(1))] = (array.astype(np.float32), None)
        if not by_layer:
            raise RecordError(f"request {trace.request_id} has no router signals (not a mixture-of-experts model)")
    elif score_type == "activation":
        maxabs = trace.arrays.get("activation.maxabs")
        if maxabs is None:
            raise RecordError(f"request {trace.request_id} has no stored activation signal")
        for index in range(maxabs.shape[0]):
            by_layer[index] = (maxabs[index].astype(np.float32)[:, None], None)
    else:
        raise RecordError(f"score type must be attention, route or activation, got {score_type!r}")
    if layer is not None:
        if layer not in by_layer:
            raise RecordError(f"request {trace.request_id} has no {score_type} signal for layer {layer} "
                              f"(layers: {', '.join(map(str, sorted(by_layer)))})")
        by_layer = {layer: by_layer[layer]}
    inputs = []
    for index, (scores, layout) in sorted(by_layer.items()):
        width = scores.shape[-1] if score_type == "attention" else scores.shape[0]
        tokens = ids[:width]
        inputs.append(ReplayInput(trace.request_id, tokens, min(prompt_len, len(tokens)), index, score_type,
                                  scores, layout))
    return inputs
