"""The hook point: one attention function, registered under the project's own name.

``sparseety_attention`` is routed to by every layer of a wrapped model (``AttentionInterface`` plus
``model.set_attn_implementation``). With no active run it is plain SDPA. Inside a run it computes the
output with SDPA and, only for the rows a policy or probe needs, attention probabilities: the last
row while decoding, the observation window, or per-key column sums computed block by block (optionally on a row sample) (never
a full ``[heads, q, n]`` matrix). It then hands them to the run context, which scores, evicts and
records. Because transformers builds no mask for this name, causality is applied here: for ``q``
new rows over ``n`` keys, row ``i`` sees slots ``0 .. n - q + i`` (new keys are always the last slots).

In a packed forward (continuous batching, :mod:`sparseety.engine.packed`) the queries of many
sequences arrive side by side ``[1, heads, T, d]``; each sequence's rows attend to that sequence's
own cache through its own context, with exactly the calls a forward of that sequence alone makes.

Shapes: ``query [b, heads, q, d]``, ``key``/``value`` ``[b, kv_heads, n, d]``, output ``[b, q, heads, d]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sparseety.engine.cache import SparseLayer
from sparseety.engine.context import RunContext, active_context
from sparseety.engine.packed import active_packed, isolated
from sparseety.engine.reconstruct import reconstruction_attention, reconstruction_scores, scoring_keys
from sparseety.engine.signals import LayerSignals
from sparseety.engine.window import window_mask
from sparseety.extract.scoring import column_sums, row_probs  # noqa: F401  (the one row-probability function; tests patch it here)

ATTENTION_NAME = "sparseety"


def causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float, hidden: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
    """SDPA output ``[b, q, heads, d]`` with slot-causal masking (exactly plain SDPA when q == 1 or q == n).

    ``hidden`` (``[b, 1 or heads, q, n]`` bool, a sliding window's) replaces the causal rule: it is
    the mask transformers would build, so the call is the one plain generation makes.
    """
    q, n = query.shape[2], key.shape[2]
    if hidden is not None:
        return sdpa_attention_forward(module, query, key, value, ~hidden, scaling=scaling, **kwargs)[0]
    if q == 1 or q == n:
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)[0]
    rows = torch.arange(q, device=query.device).unsqueeze(1)
    cols = torch.arange(n, device=query.device).unsqueeze(0)
    mask = cols <= rows + (n - q)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def decode_attention_with_probs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                scaling: float, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row: output and its probabilities from a single q·K pass (no second SDPA pass).

    Used only where the step evicts anyway, so the output need not be bit-identical to SDPA.

    Returns
    -------
    output : ``[b, 1, heads, d]``.
    probs : ``[b, heads, n]`` float32.
    """
    b, h, _, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    logits = torch.matmul(query.reshape(b, kvh, h // kvh, d), key.transpose(-1, -2)).mul_(scaling)
    if hidden is not None:  # [b, 1 or kvh, 1, n]
        logits = logits.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [b, kvh, g, n]
    out = torch.matmul(probs, value)  # [b, kvh, g, d]
    return out.reshape(b, 1, h, d), probs.reshape(b, h, n).float()


def topk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                   k: int, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Decode (or draft-verify) rows that each attend only to their ``k`` visible keys with the largest ``q·k``.

    Logits are summed over the query heads of each KV group before the top-k, so a group shares one
    key set per row; ties go to the lower slot. Row ``i`` of ``q`` sees slots ``0 .. n - q + i``.

    Returns
    -------
    output : ``[b, q, heads, d]``.
    attended : ``[b, kv_heads, n]`` bool, the slots the newest row attended to.
    skipped : visible (row, kv_head, slot) triples left out, over all rows (``hidden`` slots are not visible).
    probs : ``[b, heads, n]`` probabilities of the newest row, zero on skipped slots.
    """
    b, h, q, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    g = h // kvh
    logits = torch.matmul(query.reshape(b, kvh, g * q, d), key.transpose(-1, -2)).view(b, kvh, g, q, n) * scaling
    visible = torch.arange(n, device=key.device).unsqueeze(0) <= torch.arange(q, device=key.device).unsqueeze(1) + (n - q)
    if hidden is not None:  # a sliding window: what it hides is not "skipped by top-k"
        visible = visible & ~hidden
    group_score = logits.sum(dim=2).masked_fill(~visible, float("-inf"))  # [b, kvh, q, n]
    order = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[..., :k]
    selected = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, order, True) & visible
    probs = torch.softmax(logits.masked_fill(~selected.unsqueeze(2), float("-inf")), dim=-1)
    out = torch.matmul(probs, value.unsqueeze(2))  # [b, kvh, g, q, d]
    skipped = int(visible.expand(b, kvh, q, n).sum() - selected.sum())
    last = probs[:, :, :, -1].reshape(b, h, n).float()
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), selected[:, :, -1], skipped, last


def sliding_hidden(cache_layer: SparseLayer, q: int) -> torch.Tensor | None:
    """``[b, 1 or kv_heads, q, n]`` bool: keys a sliding layer's ``q`` newest rows cannot see, None when none is hidden.

    The new rows are the last ``q`` slots. A mask is built only when some key lies outside the newest
    row's window (so a decode step over a cache the window already trimmed runs unmasked, as plain
    generation does); heads that hold the same positions share one mask, the shape transformers uses.
    """
    window, positions = cache_layer.window, cache_layer.positions
    if window is None or positions is None:
        return None
    n = positions.shape[-1]
    rows = positions[0, 0, n - q:]
    if int(positions.amin()) > int(rows[-1]) - window:
        return None
    if positions.shape[1] > 1 and bool((positions == positions[:, :1]).all()):
        positions = positions[:, :1]
    return ~window_mask(rows, positions, window)


def sparseety_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None,
                        dropout: float = 0.0, **kwargs: object) -> tuple[torch.Tensor, None]:
    """The registered attention function (see module docstring)."""
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    packed = active_packed()
    if packed is not None:  # one forward over many sequences: each attends to its own cache
        layer = module.layer_idx
        outputs = []
        for segment in packed.segments:
            rows = query[:, :, segment.start : segment.start + segment.length]
            out = isolated(segment.ctx, _attend_own_cache, segment.ctx, module, rows, layer, scaling, kwargs)
            outputs.append(torch.zeros_like(rows.transpose(1, 2)) if out is None else out)  # a failed sequence's rows
        return torch.cat(outputs, dim=1), None
    ctx = active_context()
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return attend(ctx, module, query, key, value, scaling, kwargs), None


def _attend_own_cache(ctx: RunContext, module: torch.nn.Module, rows: torch.Tensor, layer: int, scaling: float,
                      kwargs: dict) -> torch.Tensor:
    """One packed segment's rows ``[1, heads, q, d]`` over its own cache layer: output ``[1, q, heads, d]``."""
    cache_layer = ctx.cache.layers[layer]
    return attend(ctx, module, rows, cache_layer.keys, cache_layer.values, scaling, kwargs)


def attend(ctx: RunContext, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float, kwargs: dict) -> torch.Tensor:
    """One sequence's attention through its run context: output ``[b, q, heads, d]``; the context scores and evicts."""
    layer = module.layer_idx
    if ctx.cache.layers[layer].regions is not None:
        return attend_split(ctx, module, query, scaling, kwargs)
    chunk = ctx.reconstruction.chunk
    if chunk is not None and ctx.cache.layers[layer].window is not None:
        # kvzip's pass on a sliding layer: its window attention only (the layer keeps its newest slots, unscored)
        out = causal_attention(module, query, key, value, scaling, sliding_hidden(ctx.cache.layers[layer], query.shape[2]),
                               **kwargs)
        ctx.observe(layer, key, LayerSignals())
        return out
    if chunk is not None and chunk.local:  # attend="chunk": the rows see their scoring set only
        key, value, chunk = scoring_keys(key, value, chunk)
    if chunk is not None:  # kvzip's reconstruction pass: output and slot scores in one go (CPU)
        fused = reconstruction_attention(query, key, value, scaling, chunk)
        if fused is not None:
            ctx.observe(layer, key, LayerSignals(reconstruction=fused[1]))
            return fused[0]
    q, n = query.shape[2], key.shape[2]
    plan = ctx.plan(layer, q, n)
    seen = LayerSignals()
    hidden = sliding_hidden(ctx.cache.layers[layer], q)
    if plan.topk is not None and n > plan.topk:
        out, seen.attended, seen.skipped, seen.last_row = topk_attention(query, key, value, scaling, plan.topk, hidden)
    elif q == 1 and plan.last_row and ctx.will_evict(layer, n):
        out, seen.last_row = decode_attention_with_probs(query, key, value, scaling, hidden)
    else:
        out = causal_attention(module, query, key, value, scaling, hidden, **kwargs)
        if plan.colsum_stride:
            seen.colsum = column_sums(query, key, scaling, plan.colsum_stride, last=plan.colsum_last, hidden=hidden)
    rows = min(q, plan.window_rows)
    if rows > 0:
        seen.window = row_probs(query[:, :, q - rows:], key, scaling, None if hidden is None else hidden[:, :, q - rows:])
        seen.last_row = seen.window[:, :, -1]
    elif plan.last_row and seen.last_row is None:
        seen.last_row = row_probs(query[:, :, q - 1:], key, scaling, None if hidden is None else hidden[:, :, q - 1:])[:, :, 0]
    drafts = ctx.forward.drafts
    prune_rows = min(q - drafts, ctx.prune_rows(layer))
    if prune_rows > 0:  # token pruning after this layer: reuse the rows computed above where they suffice
        if drafts == 0 and seen.window is not None and seen.window.shape[2] >= prune_rows:
            probs = seen.window[:, :, -prune_rows:]
        elif drafts == 0 and prune_rows == 1 and seen.last_row is not None:
            probs = seen.last_row.unsqueeze(2)
        else:  # the last prompt rows, over the keys they see (drafts fed after the prompt excluded)
            rows_hidden = None if hidden is None else hidden[:, :, q - drafts - prune_rows: q - drafts, : n - drafts]
            probs = row_probs(query[:, :, q - drafts - prune_rows: q - drafts], key[:, :, : n - drafts], scaling,
                              rows_hidden)
        assert ctx.prune is not None
        ctx.prune.take_scores(probs)
    if chunk is not None:  # kvzip's reconstruction pass elsewhere: score the region's slots from these queries
        seen.reconstruction = reconstruction_scores(query, key, scaling, chunk)
    seen.values = value
    if plan.query_rows:  # only for policies that read query rows (a view, no copy)
        seen.queries, seen.rotary = query[:, :, q - plan.query_rows:], ctx.rotary(layer, module)
    ctx.observe(layer, key, seen)
    return out


def attend_split(ctx: RunContext, module: torch.nn.Module, query: torch.Tensor, scaling: float,
                 kwargs: dict) -> torch.Tensor:
    """Attention over a layer split per KV head (kvzip's per-head counts): each KV group's ``g`` query
    heads ``[1, g, q, d]`` attend to that head's own live slots (a contiguous view of its region).

    Only plain attention and the newest row's probabilities are computed (what decoding, recording
    and the policy need): a split layer has passed the prefill that needs the rest.

    Returns the output ``[1, q, heads, d]``; the newest row's attention per head goes to the context.
    """
    layer = module.layer_idx
    regions = ctx.cache.layers[layer].regions
    assert regions is not None
    q = query.shape[2]
    g = query.shape[1] // regions.heads
    plan = ctx.plan(layer, q, regions.held())
    if plan.topk is not None or plan.window_rows or plan.colsum_stride or plan.query_rows or ctx.prune_rows(layer):
        raise RuntimeError(f"layer {layer} is stored per KV head: it supports neither top-k attention, "
                           "prefill signals, query rows nor token pruning")
    # the newest row's attention per slot of the row (its KV group's mean; 0 on free slots)
    signal = torch.zeros(1, 1, regions.pos.shape[-1], device=query.device) if plan.last_row else None
    if q == 1:  # the decode step: two plain matrix products per head, ``[g, d] @ [d, n_i]``, into one output
        out = query.new_empty(1, 1, query.shape[1], query.shape[-1])
        heads_out, rows_in = out[0, 0], query[0, :, 0]
        for i in range(regions.heads):
            key, value = regions.live_rows(i)
            logits = torch.mm(rows_in[i * g : (i + 1) * g], key.t()).mul_(scaling)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            torch.mm(probs.to(value.dtype), value, out=heads_out[i * g : (i + 1) * g])
            if signal is not None:
                torch.mean(probs, dim=0, out=signal[0, 0, regions.live(i)])
        ctx.observe_split(layer, signal)
        return out
    outputs = []
    for i in range(regions.heads):
        rows = query[:, i * g : (i + 1) * g]
        key, value = regions.head_keys(i)
        outputs.append(causal_attention(module, rows, key, value, scaling, **kwargs))
        if signal is not None:
            probs = row_probs(rows[:, :, q - 1 :], key, scaling)[0, :, 0]
            torch.mean(probs, dim=0, out=signal[0, 0, regions.live(i)])
    ctx.observe_split(layer, signal)
    return torch.cat(outputs, dim=2)


def attach_hidden_hooks(model: torch.nn.Module) -> int:
    """Register, once, a read-only forward pre-hook on every attention module (``*.self_attn`` with a
    ``layer_idx``) that hands the hidden states entering it ``[b, q, D]`` to the active run's context,
    only when its policy reads them (:attr:`Policy.needs_hidden`); a packed forward's rows are split per
    sequence. Returns the number of hooks registered."""
    count = 0
    for name, module in model.named_modules():
        if name.endswith("self_attn") and isinstance(getattr(module, "layer_idx", None), int):
            module.register_forward_pre_hook(_hidden_hook, with_kwargs=True)
            count += 1
    return count


def _hidden_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    packed = active_packed()
    ctx = active_context() if packed is None else None
    if ctx is None and packed is None:
        return
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor):
        return
    layer = module.layer_idx
    if packed is not None:
        for segment in packed.segments:
            if segment.ctx.wants_hidden:
                isolated(segment.ctx, segment.ctx.take_hidden, layer,
                         hidden[:, segment.start : segment.start + segment.length])
    elif ctx is not None and ctx.wants_hidden:
        ctx.take_hidden(layer, hidden)


AttentionInterface.register(ATTENTION_NAME, sparseety_attention)
