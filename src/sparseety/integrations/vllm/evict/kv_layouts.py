"""Which :class:`.compaction.BlockLayout` one KV-cache group's layers have, found once from a layer's cache tensor
(shape and strides) and its attention backend's class name (vLLM 0.32).

vLLM 0.32 binds every attention layer a 4D *logical* view ``[blocks, S, block_size, content]`` of its KV
pages; the physical order is one of ``vllm/v1/kv_cache_layout.py: KVCacheLayout``'s six stride permutations
(``LBHNC`` HND, ``LBNHC`` NHD, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``), applied by
``vllm/v1/kv_cache_interface.py: compute_layout_strides`` / ``create_kv_cache_views``, so it shows only in the
view's strides (a ``BL..`` layout interleaves the layers in one buffer: the view's storage offset). What ``S``
and the content hold depends on the backend's ``customize_spec``; there is no ``get_kv_cache_shape`` /
``get_kv_cache_stride_order`` in 0.32 (the older ``(2, num_blocks, block_size, heads, dim)`` FlashAttention and
``(num_blocks, 2, ...)`` FlashInfer shapes are gone). Three layouts are handled:

* ``packed``: ``S`` = KV heads, content = ``[key (D) | value (D)]``. The backends' forwards read it as
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``: ``flash_attn.py: FlashAttentionImpl.forward``,
  ``triton_attn.py: TritonAttentionImpl.forward``, ``flex_attention.py: FlexAttentionImpl.forward``,
  ``hpc_attn.py: HpcAttentionImpl``, ``rocm_aiter_unified_attn.py`` (its ``customize_spec`` keeps K and V
  packed); ``flashinfer.py: FlashInferImpl.forward`` permutes by ``kv_cache_layout.layer_view_order`` and
  splits the content (``split(hs, dim=-1)``) the same way.
* ``planes``: ``S`` = 2 (keys, values), content = ``heads * D``: ``b12x.py: B12xPagedAttentionBackend.
  customize_spec`` (``num_head_slots=2``) and ``B12xPagedAttentionImpl._kv_cache_views`` (``unbind(1)``, then
  ``unflatten(-1, (heads, head_size))``).
* ``split``: the 5-D layouts of the vLLM releases before 0.32, keys and values on their own axis of size 2:
  FlashAttention's ``(2, blocks, block_size, heads, D)`` and FlashInfer's ``(blocks, 2, block_size, heads, D)``
  (``get_kv_cache_shape``), in any stride order (their ``get_kv_cache_stride_order`` HND permutation included),
  read from the tensor's strides as the 4-D ones are. A backend above whose cache is 5-D is read this way.
* ``cpu``: ``[blocks, heads, block_size, 2D]`` (``cpu_attn.py``: ``supported_kv_cache_layouts`` is ``LBHNC``
  only; the forward views it as ``(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)``), whose block interior
  is the kernel's own: probed with ``cpu_attn_reshape_and_cache`` (:func:`.compaction.probe_layout`).

Not handled (eviction off, with the reason): quantized caches (FP8 is stored as ``uint8``; FlashInfer's NVFP4
keeps K and V as separate head slots with block scales; Triton's per-token-head modes put scales in the
content), ``rocm_attn.py: RocmAttentionImpl`` (two head slots, but ``PagedAttention.split_kv_cache`` reads an
x-packed interior), ``rocm_aiter_fa.py`` (its shuffle layout rearranges whole tiles, and cannot be told from the
packed one by the tensor), the diff-KV backends (key and value head sizes differ), kernel blocks smaller than the
manager's block, and any other backend.
"""

from __future__ import annotations

import torch

from sparseety.integrations.vllm.evict.compaction import BlockLayout, CacheWriter, probe_layout

#: attention backend impl class (vLLM 0.32) -> the layout its forward reads (see the module docstring)
BACKENDS: dict[str, str] = {
    "FlashAttentionImpl": "packed",
    "FlashInferImpl": "packed",
    "TritonAttentionImpl": "packed",
    "FlexAttentionImpl": "packed",
    "HpcAttentionImpl": "packed",
    "RocmAiterUnifiedAttentionImpl": "packed",
    "B12xPagedAttentionImpl": "planes",
    "CPUAttentionBackendImpl": "cpu",
}
FLOATS = (torch.float16, torch.bfloat16, torch.float32)  #: cache dtypes whose K/V are moved as they are


def _strided(kv: torch.Tensor, kind: str, heads: int, head_dim: int) -> BlockLayout:
    """The packed or planes layout of the 4D view ``kv``, from its strides (elements)."""
    s_block, s_side, s_slot, s_content = kv.stride()
    t = torch.arange(kv.shape[2], dtype=torch.int64)[:, None]
    c = torch.arange(2 * head_dim, dtype=torch.int64)[None, :]
    if kind == "packed":  # content c of head h: key channels 0..D-1, then the value's
        return BlockLayout(t * s_slot + c * s_content, s_block, s_side, heads, kind)
    index = t * s_slot + (c // head_dim) * s_side + (c % head_dim) * s_content  # side 0 keys, 1 values
    return BlockLayout(index, s_block, head_dim * s_content, heads, kind)


def _split(kv: torch.Tensor, kv_axis: int, head_dim: int) -> BlockLayout:
    """The layout of a 5-D ``(2, blocks, block_size, heads, D)`` (``kv_axis`` 0) or ``(blocks, 2, ...)`` (1)
    cache, from its strides (elements)."""
    strides = list(kv.stride())
    s_kv = strides.pop(kv_axis)
    s_block, s_slot, s_head, s_channel = strides
    t = torch.arange(kv.shape[2], dtype=torch.int64)[:, None]
    c = torch.arange(2 * head_dim, dtype=torch.int64)[None, :]
    index = t * s_slot + (c // head_dim) * s_kv + (c % head_dim) * s_channel
    return BlockLayout(index, s_block, s_head, int(kv.shape[3]), "split")


def _split_axis(kv: torch.Tensor, backend: str, block_size: int, heads: int | None,
                head_dim: int | None) -> tuple[int | None, str]:
    """Which axis of a 5-D cache holds keys and values (0: FlashAttention's, 1: FlashInfer's), or why none."""
    if heads is None or head_dim is None:
        return None, "the backend does not say its KV heads and head size"
    fits = [axis for axis in (0, 1) if kv.shape[axis] == 2
            and tuple(kv.shape[a] for a in range(5) if a != axis)[1:] == (block_size, heads, head_dim)]
    if not fits:
        return None, (f"the 5-D cache {tuple(kv.shape)} is neither (2, blocks, {block_size}, {heads}, {head_dim}) "
                      f"nor (blocks, 2, {block_size}, {heads}, {head_dim})")
    return (1 if len(fits) == 2 and backend == "FlashInferImpl" else fits[0]), ""


def _shape_problem(kv: torch.Tensor, kind: str, block_size: int, heads: int | None,
                   head_dim: int | None) -> str | None:
    if kv.dim() != 4:
        return (f"the cache is {kv.dim()}-D {tuple(kv.shape)}, not vLLM's 4-D logical view (nor, on a GPU "
                "backend, an older release's 5-D one)")
    if kv.shape[2] != block_size:
        return f"its kernel blocks hold {kv.shape[2]} tokens, not the manager's {block_size}"
    if kind == "cpu":
        if kv.shape[3] % 2 or kv.stride()[2:] != (kv.shape[3], 1):
            return f"the CPU cache's block interior is not [block_size, 2 * head_dim] (strides {kv.stride()})"
        return None
    if heads is None or head_dim is None:
        return "the backend does not say its KV heads and head size"
    want = (heads, 2 * head_dim) if kind == "packed" else (2, heads * head_dim)
    if tuple(kv.shape[1::2]) != want:
        return f"the cache {tuple(kv.shape)} is not the {kind} K/V layout of {heads} KV heads of {head_dim}"
    return None


def _distinct(layout: BlockLayout, kv: torch.Tensor) -> tuple[BlockLayout | None, str]:
    """``layout`` and ``""`` if no two entries of a block lie at one element, else None and why."""
    if layout.index.unique().numel() != layout.index.numel():
        return None, f"the cache's strides {kv.stride()} place two entries of a block at one element"
    return layout, ""


def pick_layout(kv: torch.Tensor, block_size: int, backend: str, heads: int | None = None,
                head_dim: int | None = None, write: CacheWriter | None = None) -> tuple[BlockLayout | None, str]:
    """The layout of a KV-cache group whose first layer's cache is ``kv`` (``block_size`` tokens a block) on the
    attention backend whose impl class is named ``backend`` (``heads`` KV heads of ``head_dim``; ``write``: the
    CPU kernel's cache writer), and ``""``; or None and why eviction cannot run on it."""
    kind = BACKENDS.get(backend)
    if kind is None:
        return None, f"the attention backend {backend} is not one whose KV layout is known"
    if kv.dtype not in FLOATS:
        return None, f"the cache dtype is {kv.dtype} (a quantized KV cache)"
    if kv.dim() == 5 and kind != "cpu":
        axis, problem = _split_axis(kv, backend, block_size, heads, head_dim)
        if axis is None:
            return None, problem
        assert head_dim is not None
        return _distinct(_split(kv, axis, head_dim), kv)
    problem = _shape_problem(kv, kind, block_size, heads, head_dim)
    if problem is not None:
        return None, problem
    if kind != "cpu":
        assert heads is not None and head_dim is not None
        return _distinct(_strided(kv, kind, heads, head_dim), kv)
    if write is None:
        return None, "the CPU kernel's cache writer is not available to probe its layout"
    probed = probe_layout(write, int(kv.shape[1]), block_size, int(kv.shape[3]) // 2, kv.dtype)
    if probed is None:
        return None, "the CPU kernel's layout could not be probed"
    return BlockLayout(probed.index, int(kv.stride(0)), int(kv.stride(1)), 0, "cpu"), ""


def group_layout(caches: list[torch.Tensor], block_size: int, backend: str, heads: int | None = None,
                 head_dim: int | None = None, write: CacheWriter | None = None) -> tuple[BlockLayout | None, str]:
    """:func:`pick_layout` for a group's layers ``caches``, which must all be alike (shape, strides, dtype)."""
    if not caches:
        return None, "the KV-cache group has no attention layers here"
    first = caches[0]
    if any(kv.shape != first.shape or kv.stride() != first.stride() or kv.dtype != first.dtype for kv in caches):
        return None, "the group's layers do not share one cache shape, strides and dtype"
    return pick_layout(first, block_size, backend, heads, head_dim, write)
