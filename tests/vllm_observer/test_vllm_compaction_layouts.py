"""Compaction and slot reads on every KV-cache layout vLLM 0.32's attention backends use (issue 51 item 5), on
CPU tensors (the CUDA backends' layouts are built here as torch tensors; no GPU runs them).

Each cache is built as vLLM builds it (``vllm/v1/kv_cache_interface.py: compute_layout_strides`` and
``create_kv_cache_views``): one buffer for all layers, contiguous in the physical order of a
``KVCacheLayout`` stride permutation of the logical ``[L, B, S, N, C]``, and each layer the logical 4-D view
``[B, S, N, C]`` of it (permuted, so not contiguous; a ``BL..`` order interleaves the layers). The ``packed``
layout (``S`` = KV heads, content ``[key | value]``: FlashAttention, FlashInfer, Triton, Flex, ...) and the
``planes`` one (``S`` = 2, keys then values, content ``heads * D``: b12x) are decoded here into
``[B, H, N, 2D]`` by hand (:func:`logical`), not through :class:`BlockLayout`; the CPU one by the ``vec``
kernel's formula (keys column-major, values row-major per block and KV head). The 5-D caches of the releases
before 0.32, FlashAttention's ``(2, B, N, H, D)`` and FlashInfer's ``(B, 2, N, H, D)``, one tensor per layer in
the NHD and the HND stride order, are decoded by hand the same way.

Every logical entry of the buffer holds a distinct bit pattern (finite numbers, float32 and bfloat16), so
"bit for bit" is an integer comparison. After :func:`compact` with :func:`fill_holes`' moves the whole of every
layer must equal the expectation built here: a request's kept slots ``0..kept-1`` hold the K/V of the positions
:func:`kept_positions` says, and every other entry (its slots past ``kept``, the blocks of another request, the
free blocks, the other layers' memory) is unchanged.

Moves in ascending order: in each row (layer, KV head) of :func:`fill_holes`' ``(src, dst)``, the moves that do
something come first, their destinations strictly ascending (the lowest hole first) and below ``kept``, their
sources strictly ascending and at or past ``kept`` (so no move reads a slot another one wrote); the rest of the
row is padding, a kept slot copied onto itself.
"""

from __future__ import annotations

import pytest
import torch

from sparseety.integrations.vllm.evict.compaction import compact, fill_holes, kept_positions, read_slots
from sparseety.integrations.vllm.evict.kv_layouts import group_layout, pick_layout

L, B, H, N, D = 2, 6, 2, 4, 4  #: layers, blocks, KV heads, block size, head dim
BLOCKS = torch.tensor([3, 0, 5])  #: the compacted request's blocks (12 slots); 1 and 4 another request's
OTHER = torch.tensor([1, 4])
N_SLOTS, KEPT = 12, 5
#: vllm/v1/kv_cache_layout.py: KVCacheLayout's stride permutations of [L, B, H, N, C]
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
BITS = {torch.float32: (torch.int32, 0x3F800000), torch.bfloat16: (torch.int16, 0x3F80)}  #: int view, 1.0's bits
BACKEND = {"packed": "FlashAttentionImpl", "planes": "B12xPagedAttentionImpl", "kv-first": "FlashAttentionImpl",
           "kv-second": "FlashInferImpl"}
#: the 5-D layouts of vLLM before 0.32 (``get_kv_cache_shape``), logical axes as named, and physical orders of them:
#: the identity (NHD) and the HND one ``get_kv_cache_stride_order`` gives (heads before the block's slots)
SPLIT = {"kv-first": ((2, B, N, H, D), {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}),
         "kv-second": ((B, 2, N, H, D), {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)})}


def distinct(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Finite values of ``dtype``, each with its own bit pattern (from 1.0 up), in row-major order."""
    ints, base = BITS[dtype]
    count = 1
    for n in shape:
        count *= n
    return (torch.arange(count, dtype=torch.int64) + base).to(ints).view(dtype).reshape(shape)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(BITS[x.dtype][0])


def vllm_layers(kind: str, order: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """The layers' logical views of one buffer in physical ``order``, every entry distinct."""
    side, content = (H, 2 * D) if kind == "packed" else (2, H * D)
    shape = (L, B, side, N, content)
    raw = torch.empty([shape[d] for d in order], dtype=dtype)  # physical order, contiguous
    view = raw.permute([order.index(d) for d in range(5)])  # raw's axis i is logical axis order[i]
    assert view.shape == shape
    view.copy_(distinct(shape, dtype))
    return [view[layer] for layer in range(L)]


def split_layers(kind: str, order: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """One 5-D cache per layer (vLLM before 0.32), contiguous in physical ``order``, every entry distinct."""
    shape = SPLIT[kind][0]
    layers = []
    for layer in range(L):
        raw = torch.empty([shape[d] for d in order], dtype=dtype)
        view = raw.permute([order.index(d) for d in range(5)])
        view.copy_(distinct(shape, dtype) if layer == 0 else distinct(shape, dtype).flip(0))
        layers.append(view)
    return layers


def logical(kv: torch.Tensor, kind: str) -> torch.Tensor:
    """``[B, H, N, 2D]`` (key channels, then the value's) of one layer's view, decoded by hand."""
    if kind in SPLIT:
        kv = kv if kind == "kv-second" else kv.transpose(0, 1)  # [B, 2, N, H, D]
        return kv.permute(0, 3, 2, 1, 4).reshape(B, H, N, 2 * D).clone()
    if kind == "packed":
        return kv.clone()
    planes = kv.unflatten(-1, (H, D))  # [B, 2, N, H, D]
    return planes.permute(0, 3, 2, 1, 4).reshape(B, H, N, 2 * D).clone()


def vec_write(key, value, key_cache, value_cache, slots):
    """vLLM's CPU ``vec`` cache writer (``cpu_attn_reshape_and_cache``): keys ``[D, N]`` column-major, values
    ``[N, D]`` row-major per block and KV head."""
    kc = key_cache.reshape(key_cache.shape[0], key_cache.shape[1], -1)
    vc = value_cache.reshape(value_cache.shape[0], value_cache.shape[1], -1)
    for i, slot in enumerate(slots.tolist()):
        block, t = divmod(slot, N)
        kc[block, :, torch.arange(D) * N + t] = key[i]
        vc[block, :, t * D + torch.arange(D)] = value[i]


def cpu_layers(dtype: torch.dtype) -> list[torch.Tensor]:
    from sparseety.integrations.vllm.evict.compaction import split

    kv = distinct((L, B * N, H, 2, D), dtype)
    layers = [torch.zeros(B, H, N, 2 * D, dtype=dtype) for _ in range(L)]
    for layer, cache in enumerate(layers):
        vec_write(kv[layer, :, :, 0], kv[layer, :, :, 1], *split(cache), torch.arange(B * N))
    return layers


def cpu_logical(kv: torch.Tensor) -> torch.Tensor:
    flat = kv.reshape(B, H, -1)
    t, d = torch.arange(N)[:, None], torch.arange(D)[None, :]
    return torch.cat([flat[:, :, d * N + t], flat[:, :, N * D + t * D + d]], dim=-1)  # [B, H, N, 2D]


CASES = ([(kind, name) for kind in ("packed", "planes") for name in ORDERS] + [("cpu", "LBHNC")]
         + [(kind, name) for kind, (_, orders) in SPLIT.items() for name in orders])


def build(kind: str, order: str, dtype: torch.dtype):
    if kind == "cpu":
        layers = cpu_layers(dtype)
        return layers, group_layout(layers, N, "CPUAttentionBackendImpl", None, None, vec_write), cpu_logical
    layers = split_layers(kind, SPLIT[kind][1][order], dtype) if kind in SPLIT else vllm_layers(kind, ORDERS[order],
                                                                                                   dtype)
    return layers, group_layout(layers, N, BACKEND[kind], H, D), lambda kv: logical(kv, kind)


def slots_of(table: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[H, m, 2D]`` of a request's logical ``slots`` ``[H, m]`` in ``table`` ``[B, H, N, 2D]``."""
    heads = torch.arange(H)[:, None]
    return table[block_ids[slots // N], heads, slots % N]


def check_ascending(src: torch.Tensor, dst: torch.Tensor, keep: torch.Tensor) -> None:
    for row_src, row_dst, row_keep in zip(src.reshape(-1, src.shape[-1]), dst.reshape(-1, dst.shape[-1]),
                                          keep.reshape(-1, keep.shape[-1])):
        moved = int((row_keep >= KEPT).sum())
        s, d = row_src[:moved], row_dst[:moved]
        assert bool((d[1:] > d[:-1]).all()) and bool((s[1:] > s[:-1]).all())
        assert bool((d < KEPT).all()) and bool((s >= KEPT).all())
        assert torch.equal(row_src[moved:], row_dst[moved:])  # padding: a kept slot onto itself
        assert sorted(set(row_keep.tolist()) - set(s.tolist())) == sorted(set(range(KEPT)) - set(d.tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind,order", CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_compaction_moves_exactly_the_kept_slots_bit_for_bit(kind, order, dtype):
    layers, (layout, reason), decode = build(kind, order, dtype)
    assert layout is not None and reason == "" and layout.name == ("split" if kind in SPLIT else kind)
    if order not in ("LBHNC", "NHD"):
        assert not layers[0].is_contiguous()  # a permuted (or interleaved) view, as vLLM binds it
    before = [decode(kv) for kv in layers]
    everything = torch.arange(N_SLOTS).expand(H, N_SLOTS)
    for layer, kv in enumerate(layers):  # reading slots back before any move
        want = slots_of(before[layer], everything, BLOCKS)
        assert torch.equal(bits(read_slots(kv, BLOCKS, N_SLOTS, layout)), bits(want[..., :D]))
        assert torch.equal(bits(read_slots(kv, BLOCKS, N_SLOTS, layout, values=True)), bits(want[..., D:]))

    gen = torch.Generator().manual_seed(sum(map(ord, kind + order)))
    keep = torch.stack([torch.stack([torch.randperm(N_SLOTS, generator=gen)[:KEPT] for _ in range(H)])
                        for _ in range(L)])  # [L, H, kept], any order
    keep[0, 0] = torch.tensor([11, 0, 7, 10, 8])  # most of the kept slots past ``kept``: several moves
    src, dst = moves = fill_holes(keep, KEPT)
    check_ascending(src, dst, keep.sort(dim=-1).values)
    positions = kept_positions(torch.arange(N_SLOTS).expand(L, H, N_SLOTS), moves, KEPT)  # [L, H, kept]
    assert [sorted(p) for p in positions.reshape(-1, KEPT).tolist()] == keep.reshape(-1, KEPT).sort().values.tolist()

    compact(layers, BLOCKS, moves, layout)
    first = torch.arange(KEPT).expand(H, KEPT)
    for layer, kv in enumerate(layers):
        expected = before[layer].clone()
        heads = torch.arange(H)[:, None]
        expected[BLOCKS[first // N], heads, first % N] = slots_of(before[layer], positions[layer], BLOCKS)
        got = decode(kv)
        assert torch.equal(bits(got), bits(expected))  # the whole layer: moved slots and everything else
        assert torch.equal(bits(got[OTHER]), bits(before[layer][OTHER]))  # the other request's blocks
        want = slots_of(expected, first, BLOCKS)
        assert torch.equal(bits(read_slots(kv, BLOCKS, KEPT, layout)), bits(want[..., :D]))
        assert torch.equal(bits(read_slots(kv, BLOCKS, KEPT, layout, values=True)), bits(want[..., D:]))


def test_flat_offsets_of_the_cpu_layout_are_the_contiguous_ones():
    """The CPU cache's layout keeps the numbers of a contiguous ``[B, H, N, 2D]`` cache (block and head strides
    of the tensor, the probed place inside a block and head)."""
    layers = cpu_layers(torch.float32)
    layout, _ = group_layout(layers, N, "CPUAttentionBackendImpl", None, None, vec_write)
    assert layout is not None and layout.strides(H) == (H * N * 2 * D, N * 2 * D)
    assert layout.index[3, 1].item() == 1 * N + 3 and layout.index[3, D + 1].item() == N * D + 3 * D + 1


def test_a_layout_that_fits_nothing_turns_eviction_off_with_the_reason():
    packed = vllm_layers("packed", ORDERS["LBNHC"], torch.float32)
    layout, reason = pick_layout(packed[0], N, "SomeNewAttentionImpl", H, D)
    assert layout is None and "SomeNewAttentionImpl" in reason
    for kv, backend, heads, head_dim, why in [
        (packed[0], "FlashAttentionImpl", H + 1, D, "not the packed K/V layout"),
        (packed[0], "B12xPagedAttentionImpl", H, D + 1, "not the planes K/V layout"),
        (packed[0], "FlashAttentionImpl", None, None, "does not say its KV heads"),
        (packed[0].view(torch.int32).view(torch.uint8), "FlashAttentionImpl", H, 4 * D, "quantized"),
        (packed[0].unsqueeze(0), "FlashAttentionImpl", H, D, "neither (2, blocks"),
        (packed[0].unsqueeze(0).unsqueeze(0), "FlashAttentionImpl", H, D, "not vLLM's 4-D logical view"),
        (torch.zeros(2, B, N, H, D), "FlashAttentionImpl", H + 1, D, "neither (2, blocks"),
        (torch.zeros(2, B, N, H, D, dtype=torch.uint8), "FlashAttentionImpl", H, D, "quantized"),
        (packed[0].reshape(B * 2, H, N // 2, 2 * D), "FlashAttentionImpl", H, D, "kernel blocks hold 2 tokens"),
        (torch.zeros(B, H, N, 2 * D), "CPUAttentionBackendImpl", None, None, "writer is not available"),
        (torch.zeros(B, H, N, 2 * D).transpose(1, 2).contiguous().transpose(1, 2), "CPUAttentionBackendImpl",
         None, None, "block interior"),
    ]:
        layout, reason = pick_layout(kv, N, backend, heads, head_dim)
        assert layout is None and why in reason, (backend, reason)
    layout, reason = pick_layout(torch.zeros(B, H, N, 2 * D), N, "CPUAttentionBackendImpl", write=lambda *a: None)
    assert layout is None and "could not be probed" in reason
    mixed = [packed[0], packed[1].contiguous()]
    layout, reason = group_layout(mixed, N, "FlashAttentionImpl", H, D)
    assert layout is None and "do not share" in reason
    ambiguous = torch.zeros(2, 2, N, H, D)  # two blocks: either axis could hold K and V; the backend says which
    assert pick_layout(ambiguous, N, "FlashInferImpl", H, D)[0].block_stride == ambiguous.stride(0)
    assert pick_layout(ambiguous, N, "FlashAttentionImpl", H, D)[0].block_stride == ambiguous.stride(1)
    assert group_layout([], N, "FlashAttentionImpl", H, D) == (None, "the KV-cache group has no attention layers here")
