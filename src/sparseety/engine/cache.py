"""``SparseCache``: a transformers ``Cache`` whose layers really shrink, and remember where every slot came from.

Each layer holds compacted keys/values ``[b, kv_heads, slots, d]`` (RoPE already applied, so a kept
key stays valid at its original position), the original token position of every slot
``[b, kv_heads, slots]`` in ascending order, and an optional per-slot policy accumulator. It reports
the number of tokens *seen* from ``get_seq_length`` (not the slots it holds), so ``generate`` keeps
computing the right positions.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SparseLayer(DynamicLayer):
    """One layer of a :class:`SparseCache`."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.seen = 0
        self._incoming: tuple[torch.Tensor, int] | None = None

    def expect(self, positions: torch.Tensor, fed: int) -> None:
        """Announce that the next :meth:`update` carries only the rows at ``positions`` ``[q]`` (ascending)
        of a forward that fed ``fed`` tokens (token pruning: the other rows were dropped by an earlier layer)."""
        self._incoming = (positions, fed)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[b, kv_heads, q, d]`` new keys/values at positions ``seen .. seen+q-1``
        (or at the positions announced by :meth:`expect`, the tokens seen then advancing by the whole forward)."""
        keys, values = super().update(key_states, value_states)
        b, h, q, _ = key_states.shape
        fed = q
        if self._incoming is not None:
            rows, fed = self._incoming
            self._incoming = None
            if rows.numel() != q:
                raise RuntimeError(f"SparseLayer.update: {q} new rows, but {rows.numel()} positions were announced")
            new = rows.to(key_states.device).expand(b, h, q)
        else:
            new = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        self.positions = new.clone() if self.positions is None else torch.cat([self.positions, new], dim=-1)
        if self.state is not None:
            self.state = torch.cat([self.state, self.state.new_zeros(b, h, q)], dim=-1)
        self.seen += fed
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen so far (prompt and generated), not slots held."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_slots() + query_length, 0

    def num_slots(self) -> int:
        """Slots held per KV head."""
        return 0 if self.positions is None else self.positions.shape[-1]

    def nbytes(self) -> int:
        """Bytes held by the keys and values."""
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def compact(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep only the slots ``keep`` (``[b, kv_heads, k]``, ascending) in every head.

        Returns
        -------
        evicted_slots : ``[b, kv_heads, n - k]`` slot indices (before compaction) that were dropped.
        evicted_positions : ``[b, kv_heads, n - k]`` their original token positions.
        """
        assert self.positions is not None
        n = self.positions.shape[-1]
        dropped = torch.ones_like(self.positions, dtype=torch.bool)
        dropped.scatter_(-1, keep, False)
        k = keep.shape[-1]
        evicted_slots = dropped.nonzero(as_tuple=True)[-1].reshape(*keep.shape[:-1], n - k)
        evicted_positions = self.positions.gather(-1, evicted_slots)
        b, h, _, d = self.keys.shape
        rows = (keep + torch.arange(b * h, device=keep.device).view(b, h, 1) * n).reshape(-1)
        self.keys = self.keys.reshape(b * h * n, d).index_select(0, rows).view(b, h, k, d)
        self.values = self.values.reshape(b * h * n, d).index_select(0, rows).view(b, h, k, d)
        self.positions = self.positions.gather(-1, keep)
        if self.state is not None:
            self.state = self.state.gather(-1, keep)
        return evicted_slots, evicted_positions

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (rejected speculative drafts)."""
        if tokens_to_remove > 0:
            raise ValueError("SparseLayer.crop takes a negative count of tokens to remove")
        r = -tokens_to_remove
        if r == 0 or self.positions is None:
            return
        cutoff = self.seen - r
        if not bool((self.positions[..., -r:] >= cutoff).all()):
            raise RuntimeError("cannot crop: the newest slots were evicted")  # protected while drafting
        self.keys = self.keys[..., :-r, :]
        self.values = self.values[..., :-r, :]
        self.positions = self.positions[..., :-r]
        if self.state is not None:
            self.state = self.state[..., :-r]
        self.seen = cutoff

    def reset(self) -> None:
        super().reset()
        self.positions = self.state = None
        self.seen = 0
        self._incoming = None


class SparseCache(Cache):
    """A cache of :class:`SparseLayer` s, one per decoder layer."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[SparseLayer() for _ in range(num_layers)])
        self.cropped_tokens = 0  #: tokens removed by ``crop`` (rejected speculative drafts)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens from every layer, counting them."""
        self.cropped_tokens += max(0, -tokens_to_remove)
        super().crop(tokens_to_remove)

    def nbytes(self) -> int:
        """Bytes of keys and values held across layers (the real memory footprint)."""
        return sum(layer.nbytes() for layer in self.layers)

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer, ``[b, kv_heads, slots]`` original positions of the slots held."""
        return [layer.positions for layer in self.layers]
