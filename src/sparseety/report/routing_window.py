"""The report's MoE and sliding-window sections: expert load per layer, the experts the most important
tokens were routed to, and the KV memory sliding-window layers gave back (vLLM traces).

Sources, both engines: ``router.<layer>`` ``[positions, experts]`` router probabilities (sampled requests).
vLLM traces also carry, for every request, ``vllm.moe.expert_tokens`` ``[moe layers, experts]`` (tokens
routed to each expert, each token counted once per top-k slot) and ``vllm.window.frees``
``[[step, group, blocks, bytes]]`` (blocks a windowed KV-cache group freed while scheduling that step).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

#: expert-load grids, in the order the report offers them: key -> what a cell holds
MOE_GRIDS = {
    "routed_share": "share of routed tokens (top-k, every token)",
    "top1_share": "top-1 share of tokens",
    "mean_prob": "mean router probability",
}


def router_layers(arrays: dict[str, np.ndarray]) -> list[int]:
    """The MoE layers with a ``router.<layer>`` array, ascending."""
    return sorted(int(n.split(".")[1]) for n in arrays if re.fullmatch(r"router\.\d+", n))


def moe_load(arrays: dict[str, np.ndarray], document: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Expert load per MoE layer, None without routing.

    Returns ``{layers, experts, tokens, grids, <grid key>: [layers][experts]}`` with ``grids`` the
    :data:`MOE_GRIDS` keys present: ``routed_share`` from vLLM's per-request counts, ``top1_share`` and
    ``mean_prob`` from the ``router.<layer>`` probabilities.
    """
    out: dict[str, Any] = {"grids": []}
    counted = ((document or {}).get("vllm") or {}).get("moe") or {}
    if counted.get("expert_tokens"):
        counts = np.asarray(counted["expert_tokens"], dtype=np.float64)
        share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        out.update(layers=[int(x) for x in counted["layers"]], experts=int(counts.shape[1]),
                   tokens=[int(t) for t in counted.get("tokens", [])], routed_share=share.round(4).tolist())
        out["grids"].append("routed_share")
    layers = router_layers(arrays)
    if layers:
        experts = max(int(arrays[f"router.{n}"].shape[1]) for n in layers)
        mean = np.zeros((len(layers), experts))
        top1 = np.zeros((len(layers), experts))
        tokens = []
        for row, layer in enumerate(layers):
            probs = arrays[f"router.{layer}"].astype(np.float32)
            probs = probs[~np.isnan(probs).any(axis=1)]  # positions vLLM did not compute (prefix-cache hits)
            tokens.append(int(probs.shape[0]))
            if probs.shape[0]:
                mean[row, : probs.shape[1]] = probs.mean(axis=0)
                top1[row, : probs.shape[1]] = np.bincount(probs.argmax(axis=1), minlength=probs.shape[1]) / probs.shape[0]
        if not out["grids"]:
            out.update(layers=layers, experts=experts, tokens=tokens)
        if out["layers"] == layers and out["experts"] == experts:
            out.update(top1_share=top1.round(4).tolist(), mean_prob=mean.round(4).tolist())
            out["grids"] += ["top1_share", "mean_prob"]
    if not out["grids"]:
        return None
    out["labels"] = {key: MOE_GRIDS[key] for key in out["grids"]}
    return out


def important_routing(arrays: dict[str, np.ndarray], top: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The expert each of the all-layer most important tokens was routed to first, per MoE layer.

    Returns ``{layers, tokens: [{rank, position, text}], experts: [tokens][layers]}`` (-1 where the
    router has no row for that position), None without ``router.<layer>`` arrays or a ranking.
    """
    layers = router_layers(arrays)
    ranked = sorted((r for r in top if r.get("layer") is None), key=lambda r: r.get("rank", 0))
    if not layers or not ranked:
        return None
    experts = []
    for record in ranked:
        row = []
        for layer in layers:
            probs = arrays[f"router.{layer}"]
            p = int(record["position"])
            ok = 0 <= p < probs.shape[0] and not np.isnan(probs[p].astype(np.float32)).any()
            row.append(int(np.argmax(probs[p].astype(np.float32))) if ok else -1)
        experts.append(row)
    return {"layers": layers, "experts": experts,
            "tokens": [{"rank": r.get("rank"), "position": r["position"], "text": r.get("text", "")} for r in ranked]}


def window_frees(document: dict[str, Any], steps: int) -> dict[str, Any] | None:
    """KV memory the windowed KV-cache groups of a vLLM request freed, None when they freed nothing.

    Returns ``{windows: {layer: window}, freed_blocks, freed_bytes, steps, bytes, groups}``: ``bytes``
    ``[steps]`` the bytes freed by all windowed groups up to and including each step ``0 .. steps - 1``
    (a free recorded past the last step counts at the last), ``groups`` ``[{group, blocks, bytes}]`` each
    group's total.
    """
    window = (document.get("vllm") or {}).get("window") or {}
    frees = window.get("frees") or []
    if not frees:
        return None
    steps = max(int(steps), 1)
    per_step = np.zeros(steps, dtype=np.int64)
    groups: dict[int, list[int]] = {}
    for step, group, blocks, nbytes in frees:
        per_step[min(max(int(step), 0), steps - 1)] += int(nbytes)
        total = groups.setdefault(int(group), [0, 0])
        total[0] += int(blocks)
        total[1] += int(nbytes)
    return {"windows": window.get("layers") or {}, "freed_blocks": int(window.get("freed_blocks", 0)),
            "freed_bytes": int(window.get("freed_bytes", 0)), "steps": list(range(steps)),
            "bytes": np.cumsum(per_step).tolist(),
            "groups": [{"group": g, "blocks": b, "bytes": n} for g, (b, n) in sorted(groups.items())]}
