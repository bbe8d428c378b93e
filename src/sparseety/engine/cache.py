"""``SparseCache``: a transformers ``Cache`` whose layers really shrink, and remember where every slot came from.

Each layer holds keys/values in a preallocated buffer ``[b, kv_heads, capacity, d]`` (RoPE already
applied, so a kept key stays valid at its original position) of which the first ``slots`` are live,
the original token position of every live slot ``[b, kv_heads, slots]``, an optional per-slot
policy accumulator, and optional per-slot value norms (``--importance value|output``: computed once,
when a value is written, by :attr:`SparseLayer.norm_fn`; they move with their slots). New tokens are written after the live slots (no copy of the cache per step).
A small eviction (a decode step) moves the newest survivors into the freed slots, so only the slots
that changed are copied; a large one (the end of a prefill) gathers the kept slots into a buffer
sized to them, so the memory really shrinks. Slots are therefore *not* always in position order:
everything that cares (tie-breaking, reports) orders by ``positions``. New rows are always the last
slots of a forward, which is what the attention function's causal rule relies on.

A layer can also be *split* (:meth:`SparseLayer.split`, kvzip's per-head counts as kvpress's
``KVzipPress`` chooses them): its KV heads then hold different numbers of slots, in the regions of
one row (:class:`~sparseety.engine.head_regions.HeadRegions`), so memory is the kept slots.

It reports the number of tokens *seen* from ``get_seq_length`` (not the slots it holds), so
``generate`` keeps computing the right positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from sparseety.engine.head_regions import HeadRegions
from sparseety.engine.slot_buffers import GROW_SLOTS, IN_PLACE_EVICTIONS, SlotBuffers
from sparseety.engine.window import hidden_by_window


class SparseLayer(SlotBuffers):
    """One layer of a :class:`SparseCache`.

    Keys, values, positions and the policy state live in preallocated buffers (:class:`SlotBuffers`,
    which also evicts); :attr:`keys`, :attr:`values`, :attr:`positions` and :attr:`state` are views of
    their live slots, or of the per-head regions once the layer is split.
    """

    def __init__(self, window: int | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.window = window  #: sliding-window layers: the window in tokens (None: a global layer)
        self.seen = 0
        self._incoming: tuple[torch.Tensor, int] | None = None
        self.regions: HeadRegions | None = None  #: a split layer: its heads' own slots (then the buffers above are None)
        #: values ``[b, kv_heads, q, d]`` -> norms ``[b, kv_heads, q, g]`` (importance scoring), or None
        self.norm_fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    # -- views ---------------------------------------------------------------------------------------
    @property
    def positions(self) -> torch.Tensor | None:
        """``[b, kv_heads, slots]`` original token position of every live slot (not in position order).

        A split layer: ``[1, 1, capacity]``, every slot of its row, -1 where free."""
        if self.regions is not None:
            return self.regions.pos
        return None if self._pos is None else self._pos[..., : self._slots]

    @property
    def norms(self) -> torch.Tensor | None:
        """``[b, kv_heads, slots, g]`` the live slots' value norms (a split layer: ``[1, 1, capacity, g]``), or None."""
        if self.regions is not None:
            return self.regions.norm
        return None if self._norm is None else self._norm[:, :, : self._slots]

    @property
    def state(self) -> torch.Tensor | None:
        """``[b, kv_heads, slots]`` the policy's per-slot accumulator, or None (a split layer: its row's)."""
        if self.regions is not None:
            return self.regions.state
        return None if self._state is None else self._state[..., : self._slots]

    @state.setter
    def state(self, value: torch.Tensor | None) -> None:
        if self.regions is not None:
            self.regions.state = value
            return
        if value is None:
            self._state = None
            return
        if self._state is None:
            assert self._pos is not None
            self._state = torch.zeros(self._pos.shape, dtype=value.dtype, device=value.device)
        live = self._state.narrow(2, 0, self._slots)
        if value.data_ptr() != live.data_ptr() or value.stride() != live.stride() or value.shape != live.shape:
            live.copy_(value)  # (a policy that accumulated in place returned the live view itself)

    def expect(self, positions: torch.Tensor, fed: int) -> None:
        """Announce that the next :meth:`update` carries only the rows at ``positions`` ``[q]`` (ascending)
        of a forward that fed ``fed`` tokens (token pruning: the other rows were dropped by an earlier layer)."""
        self._incoming = (positions, fed)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[b, kv_heads, q, d]`` new keys/values at positions ``seen .. seen+q-1``
        (or at the positions announced by :meth:`expect`, the tokens seen then advancing by the whole forward).

        Returns the live keys and values ``[b, kv_heads, slots, d]`` (views of the buffer); the new ones last.
        """
        b, h, q, d = key_states.shape
        if self.regions is not None:  # a split layer: each head's new rows after its own live slots
            if self._incoming is not None:
                raise RuntimeError("a layer split per head takes no pruned rows")
            self.regions.append(key_states, value_states, self.seen,
                                None if self.norm_fn is None else self.norm_fn(value_states))
            self.seen += q
            return key_states, value_states  # attention reads each head's own slots
        if self._k is None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self._k = key_states.new_empty(b, h, q + GROW_SLOTS, d)
            self._v = value_states.new_empty(b, h, q + GROW_SLOTS, d)
            self._pos = torch.zeros(b, h, q + GROW_SLOTS, dtype=torch.long, device=key_states.device)
            self.is_initialized = True
            if self.norm_fn is not None:
                first = self.norm_fn(value_states)
                self._norm = first.new_zeros(b, h, q + GROW_SLOTS, first.shape[-1])
        elif self._slots + q > self.capacity():
            self._reallocate(self._slots + q + GROW_SLOTS)
        assert self._k is not None and self._v is not None and self._pos is not None
        start, end = self._slots, self._slots + q
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        fed = q
        if self._incoming is not None:
            rows, fed = self._incoming
            self._incoming = None
            if rows.numel() != q:
                raise RuntimeError(f"SparseLayer.update: {q} new rows, but {rows.numel()} positions were announced")
            self._pos[..., start:end] = rows.to(key_states.device)
        elif q == 1:
            self._pos[..., start] = self.seen
        else:
            self._pos[..., start:end] = torch.arange(self.seen, self.seen + q, device=key_states.device)
        if self._state is not None:
            self._state[..., start:end] = 0
        if self._norm is not None and self.norm_fn is not None:
            self._norm[:, :, start:end] = self.norm_fn(value_states)
        self._slots = end
        self.seen += fed
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Tokens seen so far (prompt and generated), not slots held."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_slots() + query_length, 0

    def num_slots(self) -> int:
        """Slots held per KV head (a split layer: by all its heads together)."""
        return self._slots if self.regions is None else self.regions.held()

    def nbytes(self) -> int:
        """Bytes of the live keys and values (what the layer holds; the buffer may hold a few more free slots)."""
        if self.regions is not None:
            return self.regions.nbytes()
        if self._k is None or self._slots == 0:
            return 0
        b, h, _, d = self._k.shape
        return 2 * b * h * self._slots * d * self._k.element_size()

    def allocated_bytes(self) -> int:
        """Bytes of the whole key and value buffers, free slots included."""
        if self.regions is not None:
            return self.regions.allocated_bytes()
        return 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()

    def split(self, keep: list[torch.Tensor], budgets: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Let each KV head keep its own slots: head ``i`` keeps ``keep[i]`` ``[k_i]`` (slot indices), and
        ``budgets[i]`` slots from then on (:class:`HeadRegions`; memory is the kept slots).

        Returns, per head, ``(evicted_slots, evicted_positions)``, each ``[1, 1, e_i]`` ordered by position.
        """
        positions = self.positions
        assert positions is not None and self.keys is not None and self.values is not None
        b, h, n = positions.shape
        if b != 1 or len(keep) != h or len(budgets) != h:
            raise RuntimeError(f"split needs one sequence and one keep set and budget per KV head, got b={b}, "
                               f"{len(keep)} sets and {len(budgets)} budgets for {h} heads")
        evicted = []
        for i, slots in enumerate(keep):
            dropped = torch.ones(n, dtype=torch.bool, device=slots.device).index_fill_(0, slots, False)
            where = dropped.nonzero(as_tuple=True)[0].view(1, 1, -1)
            evicted.append((where, positions[:, i : i + 1].gather(-1, where)))
        state, norms = self.state, self.norms
        self.regions = HeadRegions(self.keys[0], self.values[0], positions[0], None if state is None else state[0],
                                   keep, budgets, None if norms is None else norms[0])
        self._k = self._v = self._pos = self._state = self._norm = None
        self._slots = 0
        self.keys = self.values = None  # read each head's through ``regions``
        return evicted

    def head_slots(self) -> list[torch.Tensor]:
        """Per KV head, ``[slots]`` the original positions it holds (batch 0, in slot order)."""
        if self.regions is not None:
            return self.regions.head_positions()
        positions = self.positions
        assert positions is not None
        return list(positions[0])

    def hidden_slots(self) -> torch.Tensor | None:
        """``[b, kv_heads, slots]`` bool: held slots no later query can see (a sliding layer); None for a global layer."""
        if self.window is None or self.positions is None:
            return None
        return hidden_by_window(self.positions, self.seen, self.window)

    def expire(self) -> int:
        """A sliding layer: free the slots no later query can see (positions below the next query's window edge).

        When the oldest slots are the first ones (always so without a policy) they go and the others
        keep their order, so attention reads the keys in the order plain generation does; otherwise
        (a policy reordered the slots) each head drops as many of its hidden slots as every head has,
        and the policy evicts the rest first (they score lowest). Returns the slots freed per head.
        """
        positions, hidden = self.positions, self.hidden_slots()
        if positions is None or hidden is None:  # a global layer (split ones are global)
            return 0
        counts = hidden.sum(dim=-1)
        e = int(counts.min())
        if e == 0:
            return 0
        n = positions.shape[-1]
        if int(counts.max()) == e and bool(hidden[..., :e].all()):  # the first e slots, in every head
            if e > IN_PLACE_EVICTIONS:
                self._reallocate(n - e + GROW_SLOTS, torch.arange(e, n, device=positions.device).expand(*positions.shape[:-1], n - e))
            else:
                for buffer in self._slot_buffers():
                    buffer[:, :, : n - e] = buffer[:, :, e:n].clone()
                self._slots = n - e
                self._views()
            return e
        # hidden slots first (lowest position first), e per head
        order = torch.where(hidden, positions, positions.new_tensor(torch.iinfo(positions.dtype).max)).argsort(dim=-1)
        self.evict(order[..., :e])
        return e

    def truncate(self, count: int) -> None:
        """Drop the ``count`` newest slots, appended by the last :meth:`update`, and un-see them.

        A pass whose KV must leave no trace (kvzip's reconstruction) appends after the live slots and
        evicts nothing before this, so the slots go without a copy; ``seen`` and the positions of later
        tokens are as before the pass.
        """
        positions = self.positions
        if self.regions is not None:
            raise RuntimeError("cannot truncate a layer split per head")
        if count <= 0 or positions is None:
            return
        if count > self._slots or bool((positions[..., self._slots - count:] < self.seen - count).any()):
            raise RuntimeError(f"cannot truncate {count} slots: they are not the newest {count} tokens")
        self._slots -= count
        self.seen -= count
        self._views()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (rejected speculative drafts)."""
        if tokens_to_remove > 0:
            raise ValueError("SparseLayer.crop takes a negative count of tokens to remove")
        r = -tokens_to_remove
        positions = self.positions
        if r == 0 or positions is None:
            return
        if self.regions is not None:
            raise RuntimeError("cannot crop a layer split per head")  # its policy (kvzip) refuses drafting
        cutoff = self.seen - r
        newest = positions >= cutoff
        if not bool((newest.sum(dim=-1) == r).all()):
            raise RuntimeError("cannot crop: the newest slots were evicted")  # protected while drafting
        self.evict(newest.nonzero(as_tuple=True)[-1].reshape(*positions.shape[:-1], r))
        self.seen = cutoff

    def reset(self) -> None:
        self._k = self._v = self._pos = self._state = self._norm = None
        self._slots = 0
        self.regions = None
        super().reset()
        self.seen = 0
        self._incoming = None


class SparseCache(Cache):
    """A cache of :class:`SparseLayer` s, one per decoder layer."""

    def __init__(self, num_layers: int, windows: tuple[int | None, ...] | None = None) -> None:
        windows = windows or (None,) * num_layers
        super().__init__(layers=[SparseLayer(window=windows[i]) for i in range(num_layers)])
        self.cropped_tokens = 0  #: tokens removed by ``crop`` (rejected speculative drafts)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens from every layer, counting them."""
        self.cropped_tokens += max(0, -tokens_to_remove)
        super().crop(tokens_to_remove)

    def nbytes(self) -> int:
        """Bytes of keys and values held across layers (the real memory footprint)."""
        return sum(layer.nbytes() for layer in self.layers)

    def kept_positions(self) -> list[list[torch.Tensor] | None]:
        """Per layer, per KV head, ``[slots]`` original positions of the slots held (batch 0), ascending."""
        return [None if layer.positions is None else [p.sort().values for p in layer.head_slots()]
                for layer in self.layers]

    def release(self) -> None:
        """Free every layer's buffers (a finished or cancelled sequence)."""
        for layer in self.layers:
            layer.reset()
