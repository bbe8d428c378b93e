"""Turn a :class:`StoredTrace` into the plain view data a report page or a PNG figure is drawn from.

Large arrays stay NumPy arrays here (:func:`sparseety.report.pack.pack` embeds them); everything else
is plain JSON. Axes longer than :data:`MAX_AXIS` are aggregated when drawn, and the view says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparseety.errors import ConfigError
from sparseety.report.routing_window import important_routing, moe_load, router_layers, window_frees
from sparseety.report.timeline import EvictionTimeline, build_timeline
from sparseety.store import StoredTrace

MAX_AXIS = 2000  #: positions or steps past which a chart aggregates into bins


def layer_count(trace: StoredTrace) -> int:
    """Number of model layers the trace covers (0 when it carries no per-layer data)."""
    arrays, document = trace.arrays, trace.document
    candidates = [0]
    for name in ("importance", "activation.maxabs"):
        if name in arrays:
            candidates.append(int(arrays[name].shape[0]))
    if "step_importance" in arrays:
        candidates.append(int(arrays["step_importance"].shape[1]))
    kept = (document.get("sparsity") or {}).get("kept_positions_final") or {}
    candidates.append(len(kept))
    for prefix in ("evicted", "attended", "skipped", "pruned", "window"):
        if len(arrays.get(f"{prefix}.layer", ())):
            candidates.append(int(np.max(arrays[f"{prefix}.layer"])) + 1)
    candidates += [layer + 1 for layer in router_layers(arrays)]
    return max(candidates)


def check_layer(trace: StoredTrace, layer: int | None) -> None:
    """Raise :class:`ConfigError` when ``layer`` is not a layer of the trace."""
    if layer is None:
        return
    n = layer_count(trace)
    if n == 0:
        raise ConfigError(f"--layer {layer}: this trace has no per-layer data (tier {trace.tier})")
    if not 0 <= layer < n:
        raise ConfigError(f"--layer {layer} does not exist: the trace has layers 0..{n - 1}")


def trace_view(trace: StoredTrace, *, layer: int | None = None) -> dict[str, Any]:
    """Everything the report shows about one run.

    Parameters
    ----------
    trace : the stored run.
    layer : layer selected when the page opens (None: all layers).

    Returns
    -------
    dict with ``kind="trace"``, ``summary``, ``tokens``, ``importance`` ``[layers + 1, positions]``
    float16 (row 0 sums all layers, row ``i + 1`` is layer ``i``; NaN where a position has no score),
    ``ranks`` (same shape, 0 = most important), ``timeline`` (:class:`EvictionTimeline`), ``kept_fraction``,
    ``top``, and the optional ``compare``, ``moe``, ``drafts``, ``pruning`` sections.
    """
    check_layer(trace, layer)
    document, arrays = trace.document, trace.arrays
    prompt_ids = [int(t) for t in document.get("prompt_token_ids") or []]
    output_ids = [int(t) for t in document.get("output_token_ids") or []]
    ids = prompt_ids + output_ids
    positions = len(ids)
    num_layers = layer_count(trace)
    sparsity = document.get("sparsity") or {}
    kept_final = sparsity.get("kept_positions_final") or {}
    kv_heads = _kv_heads(kept_final, arrays)
    steps = _steps(arrays, len(output_ids))
    texts = list(document.get("token_texts") or [])
    view: dict[str, Any] = {
        "kind": "trace",
        "request_id": trace.request_id,
        "title": f"{document.get('model', 'run')} · {sparsity.get('policy', '?')} · {trace.request_id[:12]}",
        "layer": layer,
        "layers": num_layers,
        "kv_heads": kv_heads,
        "steps": steps,
        "positions": positions,
        "prompt_len": len(prompt_ids),
        "budget": sparsity.get("budget"),
        "summary": summary(document),
        "provenance": document.get("provenance") or {},
        "output_text": document.get("text", ""),
        "tokens": {"ids": ids, "text": texts if len(texts) == positions else [f"⟨{t}⟩" for t in ids]},
        "top": list(document.get("important_tokens") or []),
        "notes": [],
        "max_axis": MAX_AXIS,
    }
    importance = _importance(arrays.get("importance"), num_layers, positions)
    view["importance"] = importance
    view["ranks"] = None if importance is None else ranks(importance)
    timeline = build_timeline(arrays, num_layers=num_layers, positions=positions, kv_heads=kv_heads,
                              steps=steps, prompt_len=len(prompt_ids))
    view["timeline"] = timeline if num_layers else None
    view["evicts"] = bool(len(arrays.get("evicted.step", ())))
    view["kept_fraction"] = kept_fraction(kept_final, timeline, num_layers, positions)
    view["compare"] = document.get("compare")
    view["moe"] = moe_load(arrays, document)
    view["routing"] = important_routing(arrays, view["top"])
    view["window_frees"] = window_frees(document, steps)
    view["drafts"] = drafts_per_step(arrays)
    view["pruning"] = pruning_per_layer(arrays, num_layers, len(prompt_ids))
    view["marks"] = token_marks(arrays, positions)
    if positions > MAX_AXIS:
        view["notes"].append(f"{positions:,} positions: the timeline aggregates them into bins of "
                             f"{-(-positions // MAX_AXIS)} positions (colour = share of the bin in each state).")
    if steps > MAX_AXIS:
        view["notes"].append(f"{steps:,} steps: the timeline aggregates them into bins of {-(-steps // MAX_AXIS)} steps.")
    if importance is None:
        view["notes"].append(f"Tier {trace.tier} trace: no importance scores (record at tier 2 or 3 to shade tokens).")
    if not texts and ids:
        why = " (ids-only trace)" if document.get("ids_only") else ""
        view["notes"].append(f"Token texts were not stored{why}: tokens show as ⟨id⟩.")
    return view


#: token lifecycle marks of the text view: mark -> (array prefix, what it means)
MARKS = {
    "cached": ("cached", "prefill skipped: KV served from the prefix cache"),
    "recomputed": ("recomputed", "KV freed by a preemption, computed again"),
    "rejected": ("drafted", "a draft proposed here was rejected"),
    "sink": ("sink", "attention sink: left out of the rankings and of the shading scale"),
}


def token_marks(arrays: dict[str, np.ndarray], positions: int) -> dict[str, list[int]] | None:
    """Positions to mark in the text view: ``cached`` (prefix-cache hits), ``recomputed`` (preemptions) and
    ``rejected`` (a rejected speculative draft at that position); None when the trace has none.

    Reads ``cached.position``, ``recomputed.position`` and ``drafted.{position,rejected}`` (the same for
    SparSEEty's own ``--speculative`` runs and vLLM's; a vLLM trace recorded without the ``drafts`` hook
    has draft positions -1, which mark nothing).
    """
    marks: dict[str, list[int]] = {}
    for mark, (prefix, _) in MARKS.items():
        where = np.asarray(arrays.get(f"{prefix}.position", ()), dtype=np.int64)
        if mark == "rejected" and where.size:
            where = where[np.asarray(arrays.get("drafted.rejected", np.zeros_like(where))) != 0]
        where = np.unique(where[(where >= 0) & (where < positions)])
        if where.size:
            marks[mark] = where.tolist()
    return marks or None


def summary(document: dict[str, Any]) -> list[tuple[str, list[tuple[str, Any]]]]:
    """The summary section as ``[(group, [(label, value), ...]), ...]``."""
    usage = document.get("usage") or {}
    sparsity = document.get("sparsity") or {}
    timings = document.get("timings") or {}
    peak, dense = sparsity.get("kv_cache_bytes_peak"), sparsity.get("kv_cache_bytes_dense")
    if peak is None:  # e.g. a vLLM trace whose engine did not report the request's KV blocks
        memory = "not reported"
    else:
        memory = f"{_mib(peak)} of {_mib(dense)} dense" + (f" ({peak / dense:.1%})" if peak and dense else "")
    rate = timings.get("decode_tokens_per_s")
    vllm = (document.get("provenance") or {}).get("engine") == "vllm"
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    lifecycle: list[tuple[str, Any]] = [("evicted positions", sparsity.get("evicted_positions")),
                                        ("eviction events", sparsity.get("eviction_events"))]
    if not vllm:
        lifecycle.append(("skipped (top-k, window)", sparsity.get("skipped_events")))
    elif sparsity.get("skipped_events"):  # vLLM skips only what sliding windows hide (prefix-cache hits are cached)
        lifecycle.append(("skipped (sliding window)", sparsity.get("skipped_events")))
    window = (document.get("vllm") or {}).get("window") or {}
    if window.get("freed_blocks"):
        memory += f"; sliding windows freed {_mib(window['freed_bytes'])} ({window['freed_blocks']} blocks)"
    if cached is not None:
        lifecycle.append(("cached prompt tokens (prefix cache)", cached))
    lifecycle.append(("drafts (rejected)", f"{sparsity.get('draft_tokens', 0)} ({sparsity.get('draft_rejected', 0)})"))
    return [
        ("Run", [("request", document.get("request_id")), ("model", document.get("model")),
                 ("tier", document.get("tier")), ("prompt tokens", usage.get("prompt_tokens")),
                 ("completion tokens", usage.get("completion_tokens")), ("total tokens", usage.get("total_tokens"))]),
        ("Sparsity", [("policy", sparsity.get("policy")), ("params", _params(sparsity.get("params"))),
                      ("budget", sparsity.get("budget")), *lifecycle]),
        ("Memory and time", [("KV cache peak", memory),
                             ("prefill", _seconds(timings.get("prefill_s"))),
                             ("decode", _seconds(timings.get("decode_s"))),
                             ("decode rate", f"{rate:.1f} tokens/s" if rate else "—")]),
    ]


def ranks(importance: np.ndarray) -> np.ndarray:
    """``[rows, positions]`` rank of each position within its row (0 = highest score, ties: lower position).

    Positions without a score (NaN) rank after every scored one.
    """
    values = np.nan_to_num(importance.astype(np.float32), nan=-np.inf)
    out = np.empty(values.shape, dtype=np.uint32)
    order = np.arange(values.shape[1])
    for row in range(values.shape[0]):
        ranking = np.lexsort((order, -values[row]))
        out[row, ranking] = order
    return out


def kept_fraction(kept_final: dict[str, dict[str, list[int]]], timeline: EvictionTimeline, num_layers: int,
                  positions: int) -> list[float]:
    """Per layer, the fraction of seen positions still held at the end (mean over KV heads)."""
    seen = timeline.seq_len(timeline.steps - 1, positions)
    if not seen:
        return []
    if kept_final:
        return [float(np.mean([len(p) for p in kept_final.get(str(layer), {}).values()] or [seen]) / seen)
                for layer in range(num_layers)]
    return [float(timeline.kept_per_step[layer, -1] / seen) for layer in range(num_layers)]


def drafts_per_step(arrays: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """Proposed / accepted / rejected draft tokens per decode step.

    Reads ``draft.{step,proposed,rejected}`` (one row per forward) or, failing that, the per-token
    ``drafted.{step,rejected}`` columns.
    """
    if len(arrays.get("draft.step", ())):
        step = np.asarray(arrays["draft.step"], dtype=np.int64)
        proposed = np.asarray(arrays["draft.proposed"], dtype=np.int64)
        rejected = np.asarray(arrays["draft.rejected"], dtype=np.int64)
    elif len(arrays.get("drafted.step", ())):
        step = np.asarray(arrays["drafted.step"], dtype=np.int64)
        proposed = np.ones_like(step)
        rejected = (np.asarray(arrays["drafted.rejected"]) != 0).astype(np.int64)
    else:
        return None
    steps, inverse = np.unique(step, return_inverse=True)
    total = np.bincount(inverse, weights=proposed).astype(np.int64)
    bad = np.bincount(inverse, weights=rejected).astype(np.int64)
    return {"step": steps.tolist(), "proposed": total.tolist(), "accepted": (total - bad).tolist(),
            "rejected": bad.tolist()}


def pruning_per_layer(arrays: dict[str, np.ndarray], num_layers: int, prompt_len: int) -> dict[str, Any] | None:
    """Prompt tokens each layer computed under token pruning.

    ``layer_tokens`` ``[layers]`` (what the engine counted) when present; otherwise rebuilt from
    ``pruned.{layer,kv_head,position}``: rows pruned by layer ``L``'s ranking are gone from layer ``L + 1``
    on (kv_head -1 = every head; per-head rows count as the mean over heads). None without pruning.
    """
    if "layer_tokens" in arrays and len(arrays["layer_tokens"]):
        tokens = np.asarray(arrays["layer_tokens"], dtype=np.float64)[:num_layers]
        total = float(max(tokens.max(initial=0), prompt_len))
    elif len(arrays.get("pruned.layer", ())):
        layer = np.asarray(arrays["pruned.layer"], dtype=np.int64)
        head = np.asarray(arrays["pruned.kv_head"], dtype=np.int64)
        pos = np.asarray(arrays["pruned.position"], dtype=np.int64)
        total = float(prompt_len)
        tokens = np.empty(num_layers)
        for index in range(num_layers):
            before = layer < index
            whole = np.unique(pos[before & (head < 0)])
            per_head = [np.union1d(whole, pos[before & (head == h)]).size for h in np.unique(head[before & (head >= 0)])]
            tokens[index] = total - (np.mean(per_head) if per_head else whole.size)
    else:
        return None
    if not len(arrays.get("pruned.layer", ())) and (tokens == total).all():
        return None
    return {"layers": list(range(len(tokens))), "total": total, "remaining": tokens.round(2).tolist(),
            "pruned": (total - tokens).round(2).tolist()}


def _importance(importance: np.ndarray | None, num_layers: int, positions: int) -> np.ndarray | None:
    if importance is None or importance.ndim != 2 or not importance.shape[0]:
        return None
    values = importance.astype(np.float32)[:, :positions]
    out = np.full((num_layers + 1, positions), np.nan, dtype=np.float32)
    out[1 : values.shape[0] + 1, : values.shape[1]] = values
    out[0, : values.shape[1]] = np.nansum(values, axis=0)
    return out.astype(np.float16)


def _kv_heads(kept_final: dict[str, dict[str, list[int]]], arrays: dict[str, np.ndarray]) -> int:
    heads = [len(h) for h in kept_final.values()]
    for prefix in ("evicted", "attended", "skipped"):
        if len(arrays.get(f"{prefix}.kv_head", ())):
            heads.append(int(np.max(arrays[f"{prefix}.kv_head"])) + 1)
    return max(heads + [1])


def _steps(arrays: dict[str, np.ndarray], completion_tokens: int) -> int:
    """Timeline rows: one per forward (prefill is step 0), and at least every step an event names."""
    candidates = [completion_tokens, 1]
    for prefix in ("evicted", "attended", "skipped", "pruned"):
        if len(arrays.get(f"{prefix}.step", ())):
            candidates.append(int(np.max(arrays[f"{prefix}.step"])) + 1)
    if "step_importance" in arrays:
        candidates.append(int(arrays["step_importance"].shape[0]))
    return max(candidates)


def _params(params: Any) -> str:
    if not params:
        return "—"
    return ", ".join(f"{k}={v}" for k, v in params.items()) if isinstance(params, dict) else str(params)


def _mib(n: Any) -> str:
    return "—" if n is None else f"{n / 2**20:.2f} MiB"


def _seconds(s: Any) -> str:
    return "—" if s is None else f"{s:.3f} s"
