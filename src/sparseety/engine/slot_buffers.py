"""``SlotBuffers``: the preallocated per-slot buffers of one cache layer, and how slots are dropped from them.

A :class:`~sparseety.engine.cache.SparseLayer` that is not split per head keeps its keys, values,
original positions, the policy's per-slot accumulator and the value norms in buffers indexed
``[b, kv_heads, slot, ...]`` of which the first ``slots`` are live; new rows are written after them.
This base class owns those buffers: reallocating them (growing, or gathering the kept slots into a
buffer sized to them) and evicting. A small eviction (a decode step) moves the newest survivors
into the freed slots, so only the slots that changed are copied; a large one (the end of a prefill)
gathers the kept slots, so the memory really shrinks. Slots are therefore *not* always in position
order. Shapes: ``b`` sequences, ``kv_heads`` KV heads, ``capacity`` slots allocated, ``d`` head
dimension, ``g`` value-norm features.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

#: Slots added when a buffer grows (amortises reallocation for layers that never evict).
GROW_SLOTS = 256
#: Evictions of at most this many slots per head move survivors in place instead of reallocating.
IN_PLACE_EVICTIONS = 32


class SlotBuffers(DynamicLayer):
    """The live slots of one layer in preallocated buffers; :attr:`keys` and :attr:`values` view the live ones."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._k: torch.Tensor | None = None  #: ``[b, kv_heads, capacity, d]``
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  #: ``[b, kv_heads, capacity]`` long
        self._state: torch.Tensor | None = None  #: ``[b, kv_heads, capacity]`` float, once a policy keeps one
        self._norm: torch.Tensor | None = None  #: ``[b, kv_heads, capacity, g]`` float32, with value norms
        self._slots = 0

    def _slot_buffers(self) -> tuple[torch.Tensor, ...]:
        """Every buffer indexed ``[b, kv_heads, slot, ...]`` (keys, values, positions, and the state if held)."""
        return tuple(x for x in (self._k, self._v, self._pos, self._state, self._norm) if x is not None)

    def _views(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[:, :, : self._slots]
        self.values = self._v[:, :, : self._slots]

    def _reallocate(self, capacity: int, keep: torch.Tensor | None = None) -> None:
        """Move the live slots (or the slots ``keep`` ``[b, kv_heads, k]``, in that order) into new buffers."""
        assert self._k is not None and self._v is not None and self._pos is not None
        b, h, _, d = self._k.shape
        live = self._slots
        n = live if keep is None else keep.shape[-1]
        positions = self._pos[..., :live]
        state = None if self._state is None else self._state[..., :live]
        norms = None if self._norm is None else self._norm[:, :, :live]
        k_new, v_new = self._k.new_empty(b, h, capacity, d), self._v.new_empty(b, h, capacity, d)
        pos_new = self._pos.new_zeros(b, h, capacity)
        state_new = None if self._state is None else self._state.new_zeros(b, h, capacity)
        norm_new = None if self._norm is None else self._norm.new_zeros(b, h, capacity, self._norm.shape[-1])
        if keep is None:
            k_new[:, :, :n], v_new[:, :, :n], pos_new[..., :n] = self.keys, self.values, positions
            if state_new is not None:
                state_new[..., :n] = state
            if norm_new is not None:
                norm_new[:, :, :n] = norms
        else:
            index = keep.unsqueeze(-1).expand(b, h, n, d)
            torch.gather(self.keys, 2, index, out=k_new[:, :, :n])
            torch.gather(self.values, 2, index, out=v_new[:, :, :n])
            pos_new[..., :n] = positions.gather(-1, keep)
            if state_new is not None:
                state_new[..., :n] = state.gather(-1, keep)
            if norm_new is not None:
                norm_new[:, :, :n] = norms.gather(2, keep.unsqueeze(-1).expand(b, h, n, norms.shape[-1]))
        self._k, self._v, self._pos, self._state, self._slots = k_new, v_new, pos_new, state_new, n
        self._norm = norm_new
        self._views()

    def capacity(self) -> int:
        """Slots the buffer can hold per KV head before it grows."""
        return 0 if self._k is None else self._k.shape[2]

    def compact(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep only the slots ``keep`` (``[b, kv_heads, k]``, ascending) in every head.

        Returns
        -------
        evicted_slots : ``[b, kv_heads, n - k]`` slot indices (before compaction) that were dropped.
        evicted_positions : ``[b, kv_heads, n - k]`` their original token positions, ascending per head.
        """
        assert self._pos is not None
        positions = self._pos[..., : self._slots]
        b, h, n = positions.shape
        k = keep.shape[-1]
        kept = torch.zeros_like(positions, dtype=torch.bool).scatter_(-1, keep, True)
        evicted_slots = (~kept).nonzero(as_tuple=True)[-1].reshape(b, h, n - k)
        return self.evict(evicted_slots, keep)

    def evict(self, slots: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop the slots ``slots`` (``[b, kv_heads, e]``, distinct per head; ``keep`` may give the complement).

        A small eviction moves the newest survivors into the freed slots (only those slots are
        copied); a large one gathers the kept slots, in order, into buffers sized to them.

        Returns ``(evicted_slots, evicted_positions)``, both ``[b, kv_heads, e]`` ordered by position.
        """
        assert self._k is not None and self._v is not None and self._pos is not None
        positions = self._pos[..., : self._slots]
        b, h, n = positions.shape
        e = slots.shape[-1]
        evicted_positions = positions.gather(-1, slots)
        if e > 1:
            order = evicted_positions.argsort(dim=-1)
            slots, evicted_positions = slots.gather(-1, order), evicted_positions.gather(-1, order)
        if e == 0:
            return slots, evicted_positions
        k = n - e
        if e == 1 and b == 1:
            self.evict_one(slots)
        elif e <= IN_PLACE_EVICTIONS and b == 1:
            kept = torch.ones(h, n, dtype=torch.bool, device=slots.device).scatter_(-1, slots[0], False)
            hole_h, hole_s = (~kept[:, :k]).nonzero(as_tuple=True)  # per head, as many holes below k as survivors above
            move_h, move_s = kept[:, k:].nonzero(as_tuple=True)
            move_s = move_s + k
            for buffer in self._slot_buffers():
                buffer[0, hole_h, hole_s] = buffer[0, move_h, move_s]
            self._slots = k
            self._views()
        else:
            if keep is None:
                kept = torch.ones_like(positions, dtype=torch.bool).scatter_(-1, slots, False)
                keep = kept.nonzero(as_tuple=True)[-1].reshape(b, h, k)
            self._reallocate(k + min(GROW_SLOTS, max(8, k // 8)), keep)
        return slots, evicted_positions

    def evict_one(self, slots: torch.Tensor) -> None:
        """The decode step: drop slot ``slots`` ``[b, kv_heads, 1]`` of every head; the last live slot moves into it
        (a no-op where it is the last), one scatter per buffer."""
        n = self._slots
        b, h = slots.shape[:2]
        rows = None
        for buffer in self._slot_buffers():
            last = buffer.narrow(2, n - 1, 1)  # ``[b, kv_heads, 1, ...]``
            if b * h == 1:  # a lone row is contiguous: scatter_ refuses a source inside its own output
                last = last.clone()
            if buffer.dim() == 3:
                buffer.scatter_(2, slots, last)
                continue
            if rows is None or rows.shape != last.shape:
                rows = slots.unsqueeze(-1).expand(last.shape)
            buffer.scatter_(2, rows, last)
        self._slots = n - 1
        self._views()
