"""``StackedSlots``: every layer's slot buffers as views of stacked buffers, so a decode step evicts all layers at once.

A layer's one-slot decode eviction depends only on that layer's own positions, policy state and the
attention its newest row paid, so evicting every layer at the end of the forward keeps exactly the slots
that evicting each right after its attention does (each layer holds ``budget + 1`` slots meanwhile). Once
every layer of a sequence holds its budget, their keys, values, positions and policy state are moved into
buffers stacked over the layers (a layer's buffer becomes a view of its row), each layer's attention hands
its newest row's group mean to :meth:`StackedSlots.take`, and :meth:`StackedSlots.evict` scores, selects and
moves one slot per layer and KV head with one chain of tensor ops instead of one per layer.

Shapes: ``L`` layers, ``kv_heads`` KV heads, ``capacity`` slots allocated, ``d`` head dimension,
``n = budget + 1`` live slots during a step; the batch axis (one sequence) sits second, under the layers.
"""

from __future__ import annotations

import torch

from sparseety.engine.cache import SparseLayer
from sparseety.policies.base import Observation, Policy, Signal, select_evict

_BUFFERS = ("_k", "_v", "_pos", "_state")


class StackedSlots:
    """Keys ``[L, 1, kv_heads, capacity, d]``, values, positions ``[L, 1, kv_heads, capacity]`` and the policy's
    state (or None) of ``layers``, each layer's own buffers now views of its row."""

    def __init__(self, layers: list[SparseLayer], budget: int) -> None:
        self.layers, self.budget = layers, budget
        self.stacks: dict[str, torch.Tensor] = {}
        for name in _BUFFERS:
            first = getattr(layers[0], name)
            if first is None:
                continue
            stack = first.new_empty(len(layers), *first.shape)
            for i, layer in enumerate(layers):
                stack[i].narrow(2, 0, budget).copy_(getattr(layer, name).narrow(2, 0, budget))
                setattr(layer, name, stack[i])
            self.stacks[name] = stack
        self._rows = {name: [getattr(layer, name) for layer in layers] for name in self.stacks}
        first = layers[0]
        assert first._pos is not None
        b, kv_heads = first._pos.shape[:2]
        #: ``[L, 1, kv_heads, budget + 1]`` each layer's newest row's attention, averaged over each KV group
        self.attention = first._pos.new_zeros(len(layers), b, kv_heads, budget + 1, dtype=torch.float32)
        for layer in layers:
            layer._views()

    @classmethod
    def adopt(cls, layers: list[SparseLayer], budget: int) -> StackedSlots | None:
        """Stack ``layers`` when every one is a global layer of one sequence holding exactly ``budget`` slots in
        buffers of one shape (no value norms, a policy state in all or none); None otherwise."""
        first = layers[0]
        if first._k is None or first._slots != budget or first._k.shape[0] != 1 or first._k.shape[2] <= budget:
            return None
        shapes = [tuple(None if x is None else (x.shape, x.dtype) for x in (layer._k, layer._v, layer._pos,
                                                                           layer._state)) for layer in layers]
        if any(layer.window is not None or layer.regions is not None or layer._norm is not None
               or layer._slots != budget for layer in layers) or shapes.count(shapes[0]) != len(shapes):
            return None
        return cls(layers, budget)

    def holds(self, budget: int) -> bool:
        """True while every layer still reads its buffers from the stack and holds ``budget`` slots."""
        if budget != self.budget:
            return False
        rows = self._rows
        state = rows.get("_state")
        return all(layer._slots == budget and layer._k is k and (state is None or layer._state is state[i])
                   for i, (layer, k) in enumerate(zip(self.layers, rows["_k"])))

    def take(self, layer: int, last_row: torch.Tensor | None) -> None:
        """Keep layer ``layer``'s newest row's attention ``[1, heads, budget + 1]`` as its KV groups' mean."""
        if last_row is not None:
            out = self.attention[layer]
            b, kv_heads, n = out.shape
            torch.mean(last_row.reshape(b, kv_heads, -1, n), dim=2, out=out)

    def evict(self, policy: Policy, step: int, seed: int, seen: int) -> None:
        """Drop one slot per layer and KV head, the one :func:`select_evict` picks from ``policy``'s scores (or
        :meth:`Policy.evict_one`), as each layer's own eviction would; ``seen`` tokens were seen, the newest last."""
        n = self.budget + 1
        positions = self.stacks["_pos"][:, 0, :, :n]  # [L, kv_heads, n]
        slots = policy.evict_one(positions, seen)
        if slots is None:
            state = self.stacks.get("_state")
            live = None if state is None else state[:, 0, :, :n]
            obs = Observation(layer=0, num_layers=len(self.layers), step=step, prefill=False, positions=positions,
                              keys=self.stacks["_k"][:, 0, :, :n], state=live,
                              attention=None if policy.decode_signal is Signal.NONE else self.attention[:, 0],
                              seed=seed, values=self.stacks["_v"][:, 0, :, :n], newest=seen - 1)
            scores, new_state = policy.score(obs)
            self._keep_state(live, new_state)
            slots = select_evict(scores, self.budget, positions)
        self._move_last(slots.unsqueeze(1), n)

    def _keep_state(self, live: torch.Tensor | None, value: torch.Tensor | None) -> None:
        """Store the policy's new state ``[L, kv_heads, n]`` (as :attr:`SparseLayer.state`'s setter does per layer)."""
        if value is None:
            if live is not None:
                for layer in self.layers:
                    layer._state = None
                del self.stacks["_state"], self._rows["_state"]
            return
        if live is None:
            pos = self.stacks["_pos"]
            stack = torch.zeros(pos.shape, dtype=value.dtype, device=value.device)
            self.stacks["_state"], self._rows["_state"] = stack, list(stack)
            for layer, row in zip(self.layers, self._rows["_state"]):
                layer._state = row
            live = stack[:, 0, :, : value.shape[-1]]
        if value.data_ptr() != live.data_ptr() or value.stride() != live.stride() or value.shape != live.shape:
            live.copy_(value)

    def _move_last(self, slots: torch.Tensor, n: int) -> None:
        """Drop slot ``slots`` ``[L, 1, kv_heads, 1]`` of every layer and head: the last live slot moves into it."""
        for stack in self.stacks.values():
            last = stack.narrow(3, n - 1, 1)  # [L, 1, kv_heads, 1, ...]
            if stack.shape[0] * stack.shape[2] == 1:  # a lone row is contiguous: scatter_ refuses its own output
                last = last.clone()
            index = slots if stack.dim() == 4 else slots.unsqueeze(-1).expand(last.shape)
            stack.scatter_(3, index, last)
        for layer in self.layers:
            layer._slots = n - 1
            layer._views()
