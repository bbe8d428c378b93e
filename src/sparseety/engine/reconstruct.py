"""The reconstruction pass of a policy that scores the region it compresses by making the model repeat it (``kvzip``).

Where it runs: right after the forward that completes the region (the prompt, or under the
long-document protocol the context), before anything else is fed to that sequence. The run context
deferred that forward's eviction (``RunContext.reconstruction.pending``); :func:`run_reconstruction`
then feeds each reconstruction chunk (a repeat prompt plus context tokens) as a forward of its own
over the sequence's cache, inside :func:`reconstructing`: every layer computes its
output as usual, scores the region's slots from the chunk's queries (:func:`reconstruction_scores`)
and drops the chunk's KV at once, so ``seen``, positions and bytes are exactly the region's again.
Then each layer evicts to its budget by those scores. No token comes out of it.

``SparseEngine.generate`` calls it after its own prefill of the region; the batched engine after the
forward (packed or not) whose chunk completed the region; teacher-forced fidelity after its prefill.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from sparseety.engine.context import RunContext, activate
from sparseety.policies.base import Observation, ReconstructionChunk

#: Query rows scored at a time (the ``[heads, rows, keys]`` block stays small).
SCORE_BLOCK = 256


def reconstruction_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, chunk: ReconstructionChunk,
                          block: int = SCORE_BLOCK) -> torch.Tensor:
    """KVzip's score of the chunk's context slots: the most attention any reconstruction row gives them.

    As kvpress's ``KVzipPress.score_kvzip``: the softmax of each reconstruction row runs over the
    first ``chunk.sinks`` slots, the chunk's context slots ``chunk.start .. chunk.end - 1`` and the
    reconstruction's own keys (causal, the last ``q`` slots) only; the score is the maximum over rows
    and over the query heads of each KV group. Computed ``block`` rows at a time.

    Parameters
    ----------
    query : ``[b, heads, q, d]`` the reconstruction rows (RoPE applied).
    key : ``[b, kv_heads, n, d]`` the cache, its last ``q`` slots the reconstruction's own keys.

    Returns
    -------
    ``[b, kv_heads, chunk.end - chunk.start]`` float32.
    """
    b, h, q, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    g = h // kvh
    ctx_len = chunk.end - chunk.start
    sel = torch.cat([key[:, :, : chunk.sinks], key[:, :, chunk.start : chunk.end], key[:, :, n - q :]], dim=2)
    sel_t = sel.float().transpose(-1, -2)  # [b, kvh, d, m]
    m = sel.shape[2]
    own = m - q  # first column of the reconstruction's own keys
    best = torch.zeros(b, kvh, ctx_len, dtype=torch.float32, device=query.device)
    cols = torch.arange(m, device=query.device)
    for first in range(0, q, block):
        r = min(block, q - first)
        rows = query[:, :, first : first + r].float().reshape(b, kvh, g * r, d)
        logits = torch.matmul(rows, sel_t).view(b, kvh, g, r, m) * scaling
        hidden = cols.unsqueeze(0) > (own + first + torch.arange(r, device=query.device)).unsqueeze(1)  # [r, m]
        probs = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
        best = torch.maximum(best, probs[..., chunk.sinks : chunk.sinks + ctx_len].amax(dim=(2, 3)))
    return best


def scoring_keys(key: torch.Tensor, value: torch.Tensor,
                 chunk: ReconstructionChunk) -> tuple[torch.Tensor, torch.Tensor, ReconstructionChunk]:
    """The keys and values of ``chunk``'s scoring set only (sinks, the chunk's slots, the own keys), and the
    chunk renumbered to them: what a ``local`` chunk's rows attend to (``attend="chunk"``).

    key, value ``[b, kv_heads, n, d]``, the last ``len(chunk.ids)`` slots the reconstruction's own.
    """
    own = key.shape[2] - len(chunk.ids)
    parts = ((0, chunk.sinks), (chunk.start, chunk.end), (own, key.shape[2]))
    pick = [torch.cat([t[:, :, a:z] for a, z in parts], dim=2) for t in (key, value)]
    return pick[0], pick[1], dataclasses.replace(chunk, start=chunk.sinks, end=chunk.sinks + chunk.end - chunk.start)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
           causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output [b, h, r, d], logsumexp [b, h, r] float32)`` of CPU flash attention (no mask)."""
    out, lse = _FLASH_CPU(query, key, value, 0.0, causal, scale=scaling)
    return out, lse.float()


def reconstruction_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                             chunk: ReconstructionChunk) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reconstruction rows' attention output and their kvzip scores in one pass (CPU), None elsewhere.

    The keys split into the chunk's scoring set without the reconstruction's own keys (sinks and the
    chunk: every row sees all of them), the rest of the context, and the own keys (causal); three
    flash-attention calls give each part's output and log-sum-exp, merged into the output over all
    keys. The scoring softmax's normaliser (sinks, chunk and own keys, kvpress's) is the merge of the
    first and third, so a slot's score ``max exp(q·k * scaling - lse)`` needs one ``[rows, chunk]``
    product (the ``- lse`` folded into it as an extra dimension) and a max: no softmax over the chunk.
    Equal to :func:`reconstruction_scores` beside SDPA up to float rounding.

    Returns
    -------
    output : ``[b, q, heads, d]``.
    scores : ``[b, kv_heads, chunk.end - chunk.start]`` float32.
    """
    if _FLASH_CPU is None or query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16,
                                                                                torch.float16):
        return None
    b, h, q, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    g = h // kvh
    n_ctx = n - q
    rows = query.reshape(b, kvh, g * q, d)  # the g query heads of a KV head as extra rows: no key copies
    chunk_keys = torch.cat([key[:, :, : chunk.sinks], key[:, :, chunk.start : chunk.end]], dim=2)
    chunk_values = torch.cat([value[:, :, : chunk.sinks], value[:, :, chunk.start : chunk.end]], dim=2)
    parts = [_flash(rows, chunk_keys, chunk_values, scaling)]
    rest = [r for r in ((chunk.sinks, chunk.start), (chunk.end, n_ctx)) if r[1] > r[0]]
    if rest:
        rest_keys = torch.cat([key[:, :, a:z] for a, z in rest], dim=2)
        rest_values = torch.cat([value[:, :, a:z] for a, z in rest], dim=2)
        parts.append(_flash(rows, rest_keys, rest_values, scaling))
    own_out, own_lse = _flash(query, key[:, :, n_ctx:].repeat_interleave(g, dim=1),
                              value[:, :, n_ctx:].repeat_interleave(g, dim=1), scaling, causal=True)
    parts = [(o.reshape(b, h, q, d), lse.reshape(b, h, q)) for o, lse in parts]
    scored_lse = torch.logaddexp(parts[0][1], own_lse)  # kvpress's softmax: sinks, chunk and own keys
    total = scored_lse if len(parts) == 1 else torch.logaddexp(scored_lse, parts[1][1])
    out = own_out.float() * torch.exp(own_lse - total).unsqueeze(-1)
    for o, lse in parts:
        out += o.float() * torch.exp(lse - total).unsqueeze(-1)
    # scores: max over rows and group of exp(q·k * scaling - scored_lse), over the chunk's slots only
    ctx_len = chunk.end - chunk.start
    aug_keys = torch.cat([key[:, :, chunk.start : chunk.end].float(),
                          torch.ones(b, kvh, ctx_len, 1, device=key.device)], dim=-1).transpose(-1, -2)
    aug_rows = torch.cat([rows.float() * scaling, -scored_lse.reshape(b, kvh, g * q, 1)], dim=-1)
    best = torch.full((b, kvh, ctx_len), float("-inf"), device=query.device)
    for first in range(0, g * q, SCORE_BLOCK):
        block = torch.matmul(aug_rows[:, :, first : first + SCORE_BLOCK], aug_keys)  # [b, kvh, r, ctx_len]
        best = torch.maximum(best, block.amax(dim=2))
    return out.to(query.dtype).transpose(1, 2).contiguous(), best.exp()


def run_reconstruction(model: torch.nn.Module, ctx: RunContext, context_ids: list[int], tokenizer: Any) -> None:
    """Run the pending reconstruction of ``ctx`` (see the module docstring), then evict.

    ``context_ids`` are the region's token ids (positions ``0 .. region - 1``).
    """
    state = ctx.reconstruction
    if not state.pending:
        return
    if len(context_ids) != state.region:
        raise RuntimeError(f"reconstruction of {state.region} positions given {len(context_ids)} ids")
    chunks = ctx.settings.policy.reconstruction_chunks(context_ids, tokenizer)
    device = next(model.parameters()).device
    with activate(ctx), torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([chunk.ids], dtype=torch.long, device=device)
            with reconstructing(ctx, chunk):
                model(input_ids=ids, past_key_values=ctx.cache, use_cache=True, logits_to_keep=1)
        finish_reconstruction(ctx)


@contextlib.contextmanager
def reconstructing(ctx: RunContext, chunk: ReconstructionChunk) -> Iterator[None]:
    """Inside the block, ``ctx``'s forwards are the reconstruction ``chunk``: each layer scores the region's
    slots from its queries, then drops the chunk's KV; probes and pruning see nothing of it."""
    ctx.reconstruction.open(ctx.cache)
    held = ctx.probes, ctx.prune
    ctx.reconstruction.chunk, ctx.probes, ctx.prune = chunk, None, None
    try:
        yield
    finally:
        ctx.reconstruction.chunk = None
        ctx.probes, ctx.prune = held


def finish_reconstruction(ctx: RunContext) -> None:
    """Score every layer of ``ctx`` by its reconstruction attention, let the policy share the budget among the
    layers that compress (:meth:`Policy.allocate`) and evict to it (step 0 events)."""
    settings, taken = ctx.settings, ctx.reconstruction.scores
    scored: dict[int, torch.Tensor] = {}
    for layer, cache_layer in enumerate(ctx.cache.layers):
        positions = cache_layer.positions
        assert positions is not None
        default = positions.float() if cache_layer.window is not None else torch.zeros(positions.shape)
        scores = taken.pop(layer, default.to(positions.device))  # sliding: the newest first
        obs = Observation(layer=layer, num_layers=settings.num_layers, step=0, prefill=True, positions=positions,
                          keys=cache_layer.keys, attention=scores, state=None, seed=settings.seed)
        scored[layer], cache_layer.state = settings.policy.score(obs)
    ctx.share_out(scored, 0)
    ctx.reconstruction.pending = False
    ctx.peak_bytes = max(ctx.peak_bytes, ctx.cache.nbytes())
