"""The hook point: one attention function, registered under the project's own name.

``sparseety_attention`` is routed to by every layer of a wrapped model (``AttentionInterface`` plus
``model.set_attn_implementation``). With no active run it is plain SDPA. Inside a run it computes the
output with SDPA and, only for the rows a policy or probe needs, attention probabilities: the last
row while decoding, the observation window, or per-key column sums computed block by block (never
a full ``[heads, q, n]`` matrix). It then hands them to the run context, which scores, evicts and
records. Because transformers builds no mask for this name, causality is applied here: for ``q``
new rows over ``n`` keys, row ``i`` sees slots ``0 .. n - q + i`` (new keys are always the last slots).

Shapes: ``query [b, heads, q, d]``, ``key``/``value`` ``[b, kv_heads, n, d]``, output ``[b, q, heads, d]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sparseety.engine.context import LayerSignals, active_context

ATTENTION_NAME = "sparseety"
COLSUM_BLOCK = 512


def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, heads, r, d]`` -> ``[b, kv_heads, group, r, d]``."""
    b, h, r, d = query.shape
    return query.reshape(b, kv_heads, h // kv_heads, r, d)


def causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float, **kwargs: object) -> torch.Tensor:
    """SDPA output ``[b, q, heads, d]`` with slot-causal masking (exactly plain SDPA when q == 1 or q == n)."""
    q, n = query.shape[2], key.shape[2]
    if q == 1 or q == n:
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)[0]
    rows = torch.arange(q, device=query.device).unsqueeze(1)
    cols = torch.arange(n, device=query.device).unsqueeze(0)
    mask = cols <= rows + (n - q)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def row_probs(query_rows: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probabilities of the last ``r`` new query rows (the step's newest queries).

    Parameters
    ----------
    query_rows : ``[b, heads, r, d]``, the last ``r`` rows of the step's queries.
    key : ``[b, kv_heads, n, d]``.

    Returns
    -------
    ``[b, heads, r, n]`` float32 probabilities, causally masked.
    """
    b, h, r, _ = query_rows.shape
    kvh, n = key.shape[1], key.shape[2]
    logits = torch.matmul(_grouped(query_rows, kvh).float(), key.float().unsqueeze(2).transpose(-1, -2)) * scaling
    if r > 1:
        rows = torch.arange(r, device=key.device).unsqueeze(1)
        cols = torch.arange(n, device=key.device).unsqueeze(0)
        logits = logits.masked_fill(cols > rows + (n - r), float("-inf"))
    return torch.softmax(logits, dim=-1).reshape(b, h, r, n)


def attention_with_colsum(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                          block: int = COLSUM_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention output and the attention each key receives, block by block.

    Returns
    -------
    output : ``[b, q, heads, d]``.
    colsum : ``[b, heads, n]`` float32, the sum over query rows of the probabilities on each key.
    """
    b, h, q, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    g = h // kvh
    offset = n - q
    kt = key.unsqueeze(2).transpose(-1, -2)  # [b, kvh, 1, d, n]
    v = value.unsqueeze(2)  # [b, kvh, 1, n, d]
    qg = _grouped(query, kvh)
    out = query.new_empty(b, kvh, g, q, d)
    colsum = torch.zeros(b, kvh, g, n, dtype=torch.float32, device=query.device)
    for start in range(0, q, block):
        stop = min(q, start + block)
        visible = offset + stop  # keys any row of this block may see
        logits = torch.matmul(qg[:, :, :, start:stop], kt[..., :visible]) * scaling
        rows = torch.arange(start, stop, device=query.device).unsqueeze(1)
        cols = torch.arange(visible, device=query.device).unsqueeze(0)
        logits.masked_fill_(cols > rows + offset, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[:, :, :, start:stop] = torch.matmul(probs, v[:, :, :, :visible])
        colsum[..., :visible] += probs.sum(dim=-2, dtype=torch.float32)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), colsum.reshape(b, h, n)


def topk_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                          k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step attending only to the ``k`` keys with the largest ``q·k`` per KV head.

    Logits are summed over the query heads of each group before the top-k; ties go to the lower slot.

    Returns
    -------
    output : ``[b, 1, heads, d]``.
    attended : ``[b, kv_heads, k]`` slot indices, ascending.
    probs : ``[b, heads, n]`` probabilities, zero on skipped slots.
    """
    b, h, _, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    logits = torch.matmul(_grouped(query, kvh), key.unsqueeze(2).transpose(-1, -2)) * scaling  # [b,kvh,g,1,n]
    group_score = logits.sum(dim=2).squeeze(-2)  # [b, kvh, n]
    order = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
    attended = order[..., :k].sort(dim=-1).values
    idx = attended.unsqueeze(-1).expand(b, kvh, k, d)
    k_sel, v_sel = key.gather(2, idx), value.gather(2, idx)
    out = F.scaled_dot_product_attention(query, k_sel, v_sel, scale=scaling, enable_gqa=h != kvh)
    sel_logits = logits.gather(-1, attended[:, :, None, None, :].expand(b, kvh, h // kvh, 1, k))
    probs = torch.zeros(b, kvh, h // kvh, n, dtype=torch.float32, device=query.device)
    probs.scatter_(-1, attended[:, :, None, :].expand(b, kvh, h // kvh, k),
                   torch.softmax(sel_logits.float(), dim=-1).squeeze(-2))
    return out.transpose(1, 2).contiguous(), attended, probs.reshape(b, h, n)


def sparseety_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None,
                        dropout: float = 0.0, **kwargs: object) -> tuple[torch.Tensor, None]:
    """The registered attention function (see module docstring)."""
    ctx = active_context()
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    layer = module.layer_idx
    q, n = query.shape[2], key.shape[2]
    plan = ctx.plan(layer, q, n)
    seen = LayerSignals()
    if plan.topk is not None and q == 1 and n > plan.topk:
        out, seen.attended, seen.last_row = topk_decode_attention(query, key, value, scaling, plan.topk)
    elif plan.colsum:
        if plan.fuse_colsum:  # this prefill evicts anyway: one blockwise pass gives output and colsums
            out, seen.colsum = attention_with_colsum(query, key, value, scaling)
        else:  # keep the output bit-exact with plain SDPA
            out = causal_attention(module, query, key, value, scaling, **kwargs)
            _, seen.colsum = attention_with_colsum(query, key, value, scaling)
    else:
        out = causal_attention(module, query, key, value, scaling, **kwargs)
    rows = min(q, plan.window_rows)
    if rows > 0:
        seen.window = row_probs(query[:, :, q - rows:], key, scaling)
        seen.last_row = seen.window[:, :, -1]
    elif plan.last_row and seen.last_row is None:
        seen.last_row = row_probs(query[:, :, q - 1:], key, scaling)[:, :, 0]
    ctx.observe(layer, key, seen)
    return out, None


AttentionInterface.register(ATTENTION_NAME, sparseety_attention)
