"""Moving one request's kept K/V inside vLLM's paged KV cache, in place (the worker's side of eviction).

A layer's cache is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; how one token's key and value lie
inside a block's ``2 * block_size * head_dim`` values depends on the kernel (vLLM's CPU ``vec`` kernel stores
keys column-major and values row-major). :func:`probe_layout` finds out by writing known keys and values with
the kernel's own cache writer, so the gather never assumes a layout: if the probe cannot tell, eviction is off.

:func:`compact` keeps ``kept`` of a request's ``physical`` slots: kept slots below ``kept`` stay where they are
and kept slots at or past ``kept`` fill the holes the evicted ones left (one-slot eviction moves one token per
layer, as the own engine's does). Keys are cached after RoPE, so a moved key needs no re-rotation. Works on
whatever device holds the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: write(key [n, H, D], value [n, H, D], key_cache, value_cache, slot_mapping [n]) with the kernel's writer
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class BlockLayout:
    """``index[t, c]``: where in a block's flat ``2 * block_size * head_dim`` values (per KV head) token slot
    ``t``'s channel ``c`` lies; channels ``0..head_dim-1`` are the key, ``head_dim..`` the value."""

    index: torch.Tensor  # [block_size, 2 * head_dim] int64

    @property
    def block_size(self) -> int:
        return int(self.index.shape[0])


def split(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value views vLLM's CPU backend hands its kernels: ``[blocks, H, block_size, D]`` each."""
    blocks, heads, block_size, _ = kv.shape
    view = kv.view(blocks, heads, block_size * 2, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


def probe_layout(write: CacheWriter, heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype) -> BlockLayout | None:
    """The layout ``write`` produces, from two probes of one scratch block (None when it is not a
    one-to-one placement of every key and value channel, or the probe values are not exact in ``dtype``)."""
    if max(block_size, head_dim) > 256:  # bf16 holds the integers up to 256 exactly
        return None
    t = torch.arange(block_size, dtype=dtype)[:, None, None].expand(block_size, heads, head_dim) + 1
    d = torch.arange(head_dim, dtype=dtype)[None, None, :].expand(block_size, heads, head_dim) + 1
    slots = torch.arange(block_size, dtype=torch.int64)
    found = []
    for key, value in ((t, d), (d, t)):
        kv = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
        write(key.contiguous(), value.contiguous(), *split(kv), slots)
        found.append(kv[0, 0].reshape(-1).to(torch.int64) - 1)
    half = block_size * head_dim
    slot_of = torch.cat([found[0][:half], found[1][half:]])
    channel_of = torch.cat([found[1][:half], found[0][half:] + head_dim])
    index = torch.full((block_size, 2 * head_dim), -1, dtype=torch.int64)
    if slot_of.min() < 0 or channel_of.min() < 0 or slot_of.max() >= block_size:
        return None
    index[slot_of, channel_of] = torch.arange(2 * half)
    if (index < 0).any():
        return None
    return BlockLayout(index)


def fill_holes(keep: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` slots [m] that put the kept slots ``keep`` [kept] into slots ``0..kept-1``: kept slots
    past ``kept`` move into the holes below it, in order."""
    keep = keep.sort().values
    below = torch.zeros(kept, dtype=torch.bool, device=keep.device)
    low = keep[keep < kept]
    below[low] = True
    holes = (~below).nonzero().flatten()
    src = keep[keep >= kept]
    return src, holes


def move_slots(kv: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
               layout: BlockLayout) -> None:
    """Copy token slots ``src`` [m] to ``dst`` [m] of one request in one layer's cache ``kv``
    ``[num_blocks, H, block_size, 2D]`` (all KV heads), through its ``block_ids`` [n_blocks]."""
    if src.numel() == 0:
        return
    blocks, heads = kv.shape[0], kv.shape[1]
    flat = kv.view(blocks, heads, -1)
    size = layout.block_size
    index = layout.index.to(kv.device)
    head = torch.arange(heads, device=kv.device)[:, None, None]
    src_at = (block_ids[src // size][None, :, None], head, index[src % size][None])
    values = flat[src_at]  # [H, m, 2D]: read everything before writing
    flat[block_ids[dst // size][None, :, None], head, index[dst % size][None]] = values


def compact(kvs: list[torch.Tensor], block_ids: torch.Tensor, moves: tuple[torch.Tensor, torch.Tensor],
            layout: BlockLayout) -> None:
    """Carry out ``moves`` (:func:`fill_holes`) for one request in every layer's cache of ``kvs`` (one KV-cache
    group, one block table ``block_ids``): afterwards its kept slots are slots ``0..kept-1``."""
    src, dst = moves
    for kv in kvs:
        move_slots(kv, block_ids, src, dst, layout)


def kept_positions(positions: torch.Tensor, moves: tuple[torch.Tensor, torch.Tensor], kept: int) -> torch.Tensor:
    """The slot-to-position map [kept] after :func:`compact` of a request whose map was ``positions`` [n]."""
    src, dst = moves
    out = positions[:kept].clone()
    out[dst] = positions[src]
    return out
