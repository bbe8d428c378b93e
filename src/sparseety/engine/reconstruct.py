"""The reconstruction pass of a policy that scores the region it compresses by making the model repeat it (``kvzip``).

Where it runs: right after the forward that completes the region (the prompt, or under the
long-document protocol the context), before anything else is fed to that sequence. The run context
deferred that forward's eviction (``RunContext.reconstruction_pending``); :func:`run_reconstruction`
then feeds each reconstruction chunk (a repeat prompt plus context tokens) as a forward of its own
over the sequence's cache, with the context in its ``reconstructing`` mode: every layer computes its
output as usual, scores the region's slots from the chunk's queries (:func:`reconstruction_scores`)
and drops the chunk's KV at once, so ``seen``, positions and bytes are exactly the region's again.
Then each layer evicts to its budget by those scores. No token comes out of it.

``SparseEngine.generate`` calls it after its own prefill of the region; the batched engine after the
forward (packed or not) whose chunk completed the region; teacher-forced fidelity after its prefill.
"""

from __future__ import annotations

from typing import Any

import torch

from sparseety.engine.context import RunContext, activate
from sparseety.errors import ConfigError
from sparseety.policies.kvzip import ReconstructionChunk

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


def check_reconstruction(ctx: RunContext) -> None:
    """Refuse what the reconstruction cannot run on (a typed error naming the policy)."""
    if any(getattr(layer, "window", None) is not None for layer in ctx.cache.layers):
        raise ConfigError(f"policy {ctx.policy.name!r} does not support sliding-window models "
                          "(its reconstruction scores every slot of the context, as kvpress, which refuses Gemma 3)")


def run_reconstruction(model: torch.nn.Module, ctx: RunContext, context_ids: list[int], tokenizer: Any) -> None:
    """Run the pending reconstruction of ``ctx`` (see the module docstring), then evict.

    ``context_ids`` are the region's token ids (positions ``0 .. region - 1``).
    """
    if not ctx.reconstruction_pending:
        return
    check_reconstruction(ctx)
    if len(context_ids) != ctx.reconstruction_region:
        raise RuntimeError(f"reconstruction of {ctx.reconstruction_region} positions given {len(context_ids)} ids")
    chunks = ctx.policy.reconstruction_chunks(context_ids, tokenizer)  # type: ignore[attr-defined]
    device = next(model.parameters()).device
    with activate(ctx), torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([chunk.ids], dtype=torch.long, device=device)
            with ctx.reconstructing(chunk):
                model(input_ids=ids, past_key_values=ctx.cache, use_cache=True, logits_to_keep=1)
        ctx.finish_reconstruction()
