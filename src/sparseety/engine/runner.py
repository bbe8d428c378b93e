"""The model runner: executes one forward of a step plan and returns each sequence's greedy next token.

It only executes (the scheduler decides). A forward with one sequence is a plain forward of that
sequence through its own cache, exactly as ``model.generate`` runs it; a forward with several packs
their new tokens side by side (:mod:`sparseety.engine.packed`). Only the rows whose next token is
needed reach the LM head.
"""

from __future__ import annotations

import torch

from sparseety.engine.context import activate
from sparseety.engine.packed import PackedCache, PackedForward, Segment, activate_packed
from sparseety.engine.scheduler import Chunk


def token_ids(chunk: Chunk) -> torch.Tensor:
    """``[q]`` the token ids a chunk feeds: prompt tokens, or the request's newest output token."""
    request = chunk.request
    if chunk.start < request.prompt_len:
        return request.encoded.input_ids[0, chunk.start : chunk.end]
    return torch.tensor([request.next_token_input()], dtype=torch.long)


def run_forward(model: torch.nn.Module, num_layers: int, chunks: list[Chunk]) -> list[int | None]:
    """Run ``chunks`` as one forward; per chunk, the greedy next token (None for a chunk inside a prompt)."""
    wants = [c.end >= c.request.prompt_len for c in chunks]
    ids = [token_ids(c) for c in chunks]
    device = model.device
    with torch.inference_mode():
        if len(chunks) == 1:
            ctx = chunks[0].request.ctx
            assert ctx is not None
            with activate(ctx):
                logits = model(input_ids=ids[0].view(1, -1).to(device), past_key_values=ctx.cache, use_cache=True,
                               logits_to_keep=1).logits[0]
        else:
            segments, start = [], 0
            for c, row in zip(chunks, ids):
                assert c.request.ctx is not None
                segments.append(Segment(c.request.ctx, start, row.numel()))
                start += row.numel()
            packed = PackedForward(tuple(segments))
            positions = torch.cat([torch.arange(c.start, c.end) for c in chunks]).view(1, -1)
            last_rows = torch.tensor([s.start + s.length - 1 for s, want in zip(segments, wants) if want], dtype=torch.long)
            with activate_packed(packed):
                logits = model(input_ids=torch.cat(ids).view(1, -1).to(device), position_ids=positions.to(device),
                               past_key_values=PackedCache(num_layers, packed), use_cache=True,
                               logits_to_keep=last_rows.to(device) if last_rows.numel() else 1).logits[0]
    picks = iter(logits.float().argmax(dim=-1).tolist())
    return [next(picks) if want else None for want in wants]
