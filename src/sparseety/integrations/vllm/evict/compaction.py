"""Moving one request's kept K/V inside vLLM's paged KV cache, in place (the worker's side of eviction).

Everything here addresses vLLM's logical KV view of one layer, (block, KV head, slot, channel), channels
``0..head_dim-1`` the key and ``head_dim..2*head_dim-1`` the value, through a :class:`BlockLayout`: the flat
element offset of each logical entry in the layer's cache tensor (:func:`flat`). Which layout a layer's cache
has is found once per KV-cache group (:func:`.kv_layouts.pick_layout`): from the tensor's strides for the CUDA
backends' layouts, and for vLLM's CPU kernel, whose block interior is its own (keys column-major, values
row-major), by :func:`probe_layout`, which writes known keys and values with the kernel's own cache writer. If
no layout fits, eviction is off.

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
    """Where vLLM's logical KV view of one layer lies in its cache tensor: block ``b``'s KV head ``h``'s slot
    ``t``, channel ``c`` (``0..head_dim-1`` the key, ``head_dim..`` the value) is element
    ``b * block_stride + h * head_stride + index[t, c]`` of :func:`flat` ``(cache)``.

    ``block_stride`` and ``head_stride`` 0 are those of a contiguous ``[num_blocks, heads, block_size,
    2 * head_dim]`` cache (vLLM's CPU one: ``index`` is then the probed place inside one block and KV head's
    ``2 * block_size * head_dim`` values); ``heads`` 0 is the cache tensor's dimension 1."""

    index: torch.Tensor  # [block_size, 2 * head_dim] int64
    block_stride: int = 0
    head_stride: int = 0
    heads: int = 0
    name: str = "probed"  #: which layout, for messages

    @property
    def block_size(self) -> int:
        return int(self.index.shape[0])

    def strides(self, heads: int) -> tuple[int, int]:
        """``(block_stride, head_stride)`` in elements, for a cache of ``heads`` KV heads."""
        head = self.head_stride or self.block_size * int(self.index.shape[1])
        return self.block_stride or heads * head, head

    def kv_heads(self, kv: torch.Tensor) -> int:
        """The KV heads of the cache ``kv`` laid out this way."""
        return self.heads or int(kv.shape[1])


def flat(kv: torch.Tensor) -> torch.Tensor:
    """One layer's cache as the 1-D run of memory its elements span, from its first element: a view (writes land
    in the cache) that :class:`BlockLayout` offsets index, whatever the tensor's strides (a permuted view, a
    layer interleaved with others in one buffer)."""
    if kv.is_contiguous():
        return kv.view(-1)
    span = 1 + sum((n - 1) * s for n, s in zip(kv.shape, kv.stride()))
    return kv.as_strided((span,), (1,), kv.storage_offset())


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
    """``(src, dst)`` slots ``[..., m]`` that put the kept slots ``keep`` ``[..., kept]`` (any order) of each row
    into slots ``0..kept-1``: kept slots past ``kept`` move into the holes below it, in order. In each row the
    moves come in ascending order of destination (the lowest hole first), their sources ascending too; every
    source is at or past ``kept`` and every destination below it, so no move reads a slot another one writes.
    Rows that move fewer than ``m`` (the most any row moves) are padded, after their moves, with copies of a
    kept slot onto itself."""
    lead = keep.shape[:-1]
    keep = keep.reshape(-1, keep.shape[-1]).sort(dim=-1).values  # [R, kept]
    low = keep < kept
    below = torch.zeros(keep.shape[0], kept + 1, dtype=torch.bool, device=keep.device)
    below.scatter_(1, torch.where(low, keep, kept), True)
    moved = (~low).sum(dim=-1, keepdim=True)  # [R, 1]: holes = kept slots past ``kept``
    m = int(moved.max()) if moved.numel() else 0
    # holes first (ascending), then the kept slots below ``kept``: the padding copies one onto itself
    dst = torch.argsort(below[:, :kept].to(torch.int8), dim=1, stable=True)[:, :m]
    i = torch.arange(m, device=keep.device)
    src = keep.gather(1, (kept - moved + i).clamp(max=kept - 1)) if m else dst
    src = torch.where(i < moved, src, dst)
    return src.reshape(*lead, m), dst.reshape(*lead, m)


def slot_index(block_ids: torch.Tensor, slots: torch.Tensor, layout: BlockLayout, heads: int,
               values: bool | None = None) -> torch.Tensor:
    """Flat indices ``[H, m, C]`` into one layer's cache (its :func:`flat` view, read with :func:`torch.take`) of
    token ``slots`` (``[m]`` for every KV head, or ``[H, m]``) of the request whose
    blocks are ``block_ids``: the key channels (``values`` False), the value channels (True) or both (None, C = 2D).
    The same for every layer of a KV-cache group, so computed once per compaction or forward."""
    size, d = layout.block_size, layout.index.shape[1] // 2
    index = layout.index.to(slots.device)
    channels = index if values is None else index[:, d:] if values else index[:, :d]  # [size, C]
    slots = slots.reshape(-1, slots.shape[-1])  # [1 or H, m]
    block_stride, head_stride = layout.strides(heads)
    rows = (block_ids.to(slots.device)[slots // size] * block_stride
            + torch.arange(heads, device=slots.device)[:, None] * head_stride)
    return rows[..., None] + channels[slots % size]


def move_slots(kv: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
               layout: BlockLayout) -> None:
    """Copy token slots ``src`` to ``dst`` (``[m]`` for every KV head, or ``[H, m]`` one row per head) of one
    request in one layer's cache ``kv`` (laid out as ``layout``), through its ``block_ids`` [n_blocks]."""
    if src.numel() == 0:
        return
    heads, memory = layout.kv_heads(kv), flat(kv)
    src, dst = src.to(kv.device), dst.to(kv.device)
    values = torch.take(memory, slot_index(block_ids, src, layout, heads))  # read all, then write
    memory.put_(slot_index(block_ids, dst, layout, heads), values)


def compact(kvs: list[torch.Tensor], block_ids: torch.Tensor, moves: tuple[torch.Tensor, torch.Tensor],
            layout: BlockLayout) -> None:
    """Carry out ``moves`` (:func:`fill_holes`) for one request in every layer's cache of ``kvs`` (one KV-cache
    group, one block table ``block_ids``): afterwards its kept slots are slots ``0..kept-1``. ``moves`` are
    ``[m]`` or ``[H, m]`` (every layer alike) or ``[layers, H, m]`` (one row per layer)."""
    src, dst = moves
    for i, kv in enumerate(kvs):
        if src.dim() == 3:
            move_slots(kv, block_ids, src[i], dst[i], layout)
        else:
            move_slots(kv, block_ids, src, dst, layout)


def kept_positions(positions: torch.Tensor, moves: tuple[torch.Tensor, torch.Tensor], kept: int) -> torch.Tensor:
    """A per-slot map ``[..., kept]`` (positions, scores, a policy's state) after :func:`compact` of a request
    whose map was ``positions`` ``[..., n]`` (``moves`` ``[..., m]``, broadcast over the leading axes)."""
    src, dst = moves
    src, dst = src.expand(*positions.shape[:-1], src.shape[-1]), dst.expand(*positions.shape[:-1], dst.shape[-1])
    out = positions[..., :kept].clone()
    out.scatter_(-1, dst, positions.gather(-1, src))
    return out


def read_slots(kv: torch.Tensor, block_ids: torch.Tensor, n: int, layout: BlockLayout,
               values: bool = False, index: torch.Tensor | None = None) -> torch.Tensor:
    """The keys (or ``values``) ``[H, n, D]`` of one request's first ``n`` slots in one layer's cache ``kv``
    (``index``: their :func:`slot_index`, when the caller computed it for the group's other layers)."""
    if index is None:
        index = slot_index(block_ids, torch.arange(n, device=kv.device), layout, layout.kv_heads(kv), values)
    return torch.take(flat(kv), index)
