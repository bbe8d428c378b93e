"""Per-slot importance scores of one attention row, and the attention sinks a ranking leaves out.

The one scoring code path of the engine's hook point, offline ``extract`` records and (later) vLLM
traces. It needs torch only. Shapes: ``heads`` query heads in ``kv_heads`` groups of ``g``.

Modes (``--importance`` / ``extraction.importance``)
----------------------------------------------------
``attention``  α_hj, the newest query row's attention (today's score).
``value``      α_hj · ‖v_j‖ (VATP, arXiv 2406.12335).
``output``     α_hj · ‖W_O^h v_j‖, what slot j adds to head h's output (CriticalKV, arXiv 2502.03805).
``learned``    w_lh · (one of the above per head), with one learned non-negative weight per (layer, head)
               (AT2, arXiv 2504.13752; :mod:`sparseety.extract.head_weights`): :func:`weight_heads`
               multiplies ``row`` before :func:`score_row`.

A slot's norm depends on its value only, so it is computed once, when the value is written
(:func:`slot_norms`, ``[.., kv_heads, slots, g]``; ``g`` is 1 for ``value``), and a step costs
O(held slots). Scores are averaged over the query heads (:func:`head_scores` keeps them apart: the
features that learned head weights are fitted on).

Sinks (:func:`find_sinks`)
--------------------------
A position is a sink when it is the first position, or when it takes at least ``SINK_SHARE`` of all
the attention recorded while carrying at most ``SINK_NORM_RATIO`` of the median attention-weighted
norm (the mode's score over its attention). Sinks stay in the trace (``sink.position``) and are left
out of the rankings. ``attention`` mode computes no norms, so it marks no sinks (its traces are as
before).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparseety.options import DEFAULT_IMPORTANCE, IMPORTANCE_MODES, ImportanceMode

#: the scores a slot's norm makes (``learned`` weighs one of them per head)
FEATURES: tuple[str, ...] = ("attention", "value", "output")
MODES: tuple[str, ...] = IMPORTANCE_MODES
#: the default ``--importance`` (chosen by ``sparseety bench faithfulness``: see the README's table), written once
DEFAULT_MODE: ImportanceMode = DEFAULT_IMPORTANCE
SINK_SHARE = 0.1
SINK_NORM_RATIO = 0.5


def check_mode(mode: object, field: str = "importance") -> ImportanceMode:
    """``mode`` if it is one of :data:`MODES`, else :class:`ValueError` naming ``field`` and the choices."""
    if mode not in MODES:
        raise ValueError(f"{field} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def output_grams(weight: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """``[kv_heads, g, d, d]`` float32 Gram matrices ``W_O^hᵀ W_O^h`` of an output projection ``weight``
    ``[hidden, heads * d]`` (so ``‖W_O^h v‖² = vᵀ G_h v`` costs d² per head instead of hidden · d)."""
    hidden, width = weight.shape
    d = width // heads
    w = weight.detach().float().reshape(hidden, heads, d).transpose(0, 1)  # [heads, hidden, d]
    return (w.transpose(1, 2) @ w).reshape(kv_heads, heads // kv_heads, d, d)


def slot_norms(values: torch.Tensor, mode: ImportanceMode, grams: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., kv_heads, q, g]`` float32 norms of values ``[..., kv_heads, q, d]``: ``‖v‖`` (g = 1) for
    ``value``, ``‖W_O^h v‖`` per query head of the group for ``output`` (``grams`` from :func:`output_grams`)."""
    v = values.float()
    if mode == "value":
        return v.norm(dim=-1, keepdim=True)
    if mode != "output" or grams is None:
        raise ValueError(f"slot_norms: mode {mode!r} needs {'grams' if mode == 'output' else 'value or output'}")
    # [..., kvh, q, d] x [kvh, g, d, d] -> [..., kvh, q, g]
    quad = torch.einsum("...kqd,kgde,...kqe->...kqg", v, grams.to(v.device), v)
    return quad.clamp(min=0).sqrt()


def weight_heads(row: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The attention row ``[..., heads, n]`` with each query head's row times its weight (``[heads]``,
    ``learned``; None: ``row`` itself)."""
    return row if weights is None else row * weights.to(device=row.device, dtype=row.dtype).unsqueeze(-1)


def head_scores(row: torch.Tensor, norms: torch.Tensor | None) -> torch.Tensor:
    """``[..., heads, n]``: each query head's attention row ``[..., heads, n]`` times the slots' ``norms``
    (``[..., kv_heads, n, g]``, None for ``attention``: the row itself)."""
    if norms is None:
        return row
    lead, (h, n) = row.shape[:-2], row.shape[-2:]
    kv_heads = norms.shape[-3]
    grouped = row.reshape(*lead, kv_heads, h // kv_heads, n)
    grouped = grouped * norms.to(grouped.dtype).transpose(-1, -2)  # [.., kvh, g or 1, n]
    return grouped.reshape(*lead, h, n)


def score_row(row: torch.Tensor, norms: torch.Tensor | None, kv_heads: int | None = None) -> torch.Tensor:
    """``[..., kv_heads, n]``: :func:`head_scores` averaged over each KV group's query heads (``kv_heads``
    from ``norms``, or given, or one group per head)."""
    kv_heads = norms.shape[-3] if norms is not None else kv_heads or row.shape[-2]
    lead, (h, n) = row.shape[:-2], row.shape[-2:]
    if norms is not None and norms.shape[-1] == 1:  # one norm per slot, shared by the group: weigh the mean
        mean = row.reshape(*lead, kv_heads, h // kv_heads, n).mean(dim=-2)
        return mean * norms[..., 0].to(mean.dtype)
    scored = head_scores(row, norms)
    return scored.reshape(*lead, kv_heads, h // kv_heads, n).mean(dim=-2)


def group_mean(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Average ``[b, heads, ...]`` over the query heads of each KV group -> ``[b, kv_heads, ...]``."""
    b, h = x.shape[:2]
    return x.reshape(b, kv_heads, h // kv_heads, *x.shape[2:]).mean(dim=2)


def row_probs(query_rows: torch.Tensor, key: torch.Tensor, scaling: float,
              hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities of the last ``r`` new query rows (the step's newest queries): the rows the
    engine's hook point and the vLLM capture (:mod:`sparseety.integrations.vllm.observe.attention_capture`) score.

    Parameters
    ----------
    query_rows : ``[b, heads, r, d]``, the last ``r`` rows of the step's queries.
    key : ``[b, kv_heads, n, d]``.
    hidden : ``[b, 1 or kv_heads, r, n]`` bool, keys these rows cannot see (a sliding window), or None.

    Returns
    -------
    ``[b, heads, r, n]`` float32 probabilities, causally masked.
    """
    b, h, r, d = query_rows.shape
    kvh, n = key.shape[1], key.shape[2]
    # [b, kvh, g*r, d] @ [b, kvh, d, n]: one batched GEMM per KV head, no broadcast copies of the keys
    grouped = query_rows.float().reshape(b, kvh, (h // kvh) * r, d)
    logits = torch.matmul(grouped, key.float().transpose(-1, -2)).view(b, kvh, h // kvh, r, n) * scaling
    if r > 1:
        rows = torch.arange(r, device=key.device).unsqueeze(1)
        cols = torch.arange(n, device=key.device).unsqueeze(0)
        logits = logits.masked_fill(cols > rows + (n - r), float("-inf"))
    if hidden is not None:
        logits = logits.masked_fill(hidden.unsqueeze(2), float("-inf"))
    return torch.softmax(logits, dim=-1).reshape(b, h, r, n)


COLSUM_BLOCK = 128


def column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float, stride: int = 1,
                block: int = COLSUM_BLOCK, last: int | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Attention each key receives, summed over query rows, computed ``block`` rows at a time.

    With ``stride > 1`` only every ``stride``-th row counting back from row ``last`` is computed and
    the sums are scaled by ``stride`` (an unbiased estimate at ``1/stride`` of the cost); ``stride=1``
    is exact. ``last`` (default: the last row) may lie beyond this forward's rows: a prefill chunk
    then samples the rows the whole prefill would. ``hidden`` (``[b, 1 or kv_heads, q, n]`` bool) masks
    what a sliding window hides. Memory stays ``O(block * n)`` per head: the full
    ``[heads, q, n]`` matrix never exists.

    Parameters
    ----------
    query : ``[b, heads, q, d]``; key : ``[b, kv_heads, n, d]``.

    Returns
    -------
    ``[b, heads, n]`` float32 column sums.
    """
    b, h, q, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    g = h // kvh
    key_t = key.transpose(-1, -2).contiguous()  # [b, kv_heads, d, n]
    last = q - 1 if last is None else last
    top = last - stride * -(-(last - (q - 1)) // stride) if last > q - 1 else last  # the last sampled row here
    rows = torch.arange(top, -1, -stride, device=query.device).flip(0)
    colsum = torch.zeros(b, h, n, dtype=torch.float32, device=query.device)
    for start in range(0, rows.numel(), block):
        chunk = rows[start : start + block]
        visible = n - q + int(chunk[-1]) + 1  # keys the last row of the chunk may see
        r = chunk.numel()
        grouped = (query[:, :, chunk] * scaling).reshape(b, kvh, g * r, d)
        logits = torch.matmul(grouped, key_t[..., :visible]).reshape(b, kvh, g, r, visible)
        cols = torch.arange(visible, device=query.device).unsqueeze(0)
        logits.masked_fill_(cols > (chunk + (n - q)).unsqueeze(1), float("-inf"))
        if hidden is not None:  # [b, 1 or kvh, q, n]: a sliding window
            logits.masked_fill_(hidden[:, :, chunk, :visible].unsqueeze(2), float("-inf"))
        colsum[..., :visible] += torch.softmax(logits, dim=-1).sum(dim=-2).reshape(b, h, visible)
    return colsum * stride


def find_sinks(attention: torch.Tensor, scores: torch.Tensor | None) -> list[int]:
    """Positions that are attention sinks (see the module docstring): ``attention`` and the mode's
    ``scores`` are ``[layers, n]`` (or ``[n]``) summed over the recorded steps; None scores: position 0 only."""
    att = attention.float().reshape(-1, attention.shape[-1]).sum(dim=0)
    n = att.shape[0]
    if n == 0:
        return []
    sinks = {0}
    total = float(att.sum())
    if scores is not None and total > 0:
        weighted = scores.float().reshape(-1, n).sum(dim=0)
        seen = att > 0
        norm = torch.where(seen, weighted / att.clamp(min=1e-30), torch.zeros_like(att))
        median = float(norm[seen].median()) if bool(seen.any()) else 0.0
        heavy = (att / total >= SINK_SHARE) & (norm <= SINK_NORM_RATIO * median)
        sinks.update(heavy.nonzero().flatten().tolist())
    return sorted(sinks)


def ranking_order(scores: torch.Tensor, excluded: Sequence[int] = ()) -> list[int]:
    """Positions of ``scores`` ``[n]`` best first (ties: the lower position), ``excluded`` ones last (by position)."""
    n = scores.shape[-1]
    out = set(excluded)
    kept = [j for j in range(n) if j not in out]
    values = scores.float().tolist()
    return sorted(kept, key=lambda j: (-values[j], j)) + sorted(j for j in out if 0 <= j < n)
