"""``ImportanceSums``: the attention each position received while generating, summed per layer (tier >= 2).

The importance accumulation part of the run context. Every forward that records adds its newest row's
per-slot score into ``total`` (one ``index_add_`` per layer; a position held by several KV heads gets
each head's share). Shapes: ``layers`` decoder layers, ``positions`` tokens seen (the totals grow by
doubling), ``seen`` tokens seen at a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseety.engine.cache import SparseLayer
from sparseety.engine.layers import LayerSelection, topk_mass
from sparseety.engine.signals import group_mean
from sparseety.extract.scoring import score_row, weight_heads
from sparseety.options import ImportanceMode


@dataclass
class ImportanceSums:
    """Per layer, the importance of every position so far; at tier 3 also each step's own vector.

    Parameters
    ----------
    num_layers, kv_heads : model geometry.
    tier : the run's tier (below 2 nothing records).
    layers : which layers record; ``auto`` chooses one after the forward that completes the context.
    auto_k : ``auto``: the top-k whose attention mass chooses the layer.
    mode : the feature attention is weighed by (:mod:`sparseety.extract.scoring`).
    head_weights : ``learned``: ``[layers, heads]`` weights of each head's score, else None.
    """

    num_layers: int
    kv_heads: int
    tier: int
    layers: LayerSelection = field(default_factory=LayerSelection)
    auto_k: int = 16
    mode: ImportanceMode = "attention"
    head_weights: torch.Tensor | None = None
    total: torch.Tensor | None = None  #: ``[layers, >= positions]`` the score each position received
    attention: torch.Tensor | None = None  #: ``value``/``output``/``learned``: ``[layers, >= positions]`` plain attention too
    step_vectors: list[torch.Tensor] = field(default_factory=list)  #: tier 3: ``[layers, seen]`` float16 per step
    recorded_layers: tuple[int, ...] | None = None  #: layers recording (None: ``auto`` has not chosen yet)
    layer_mass: dict[int, float] = field(default_factory=dict)  #: ``auto``: top-k mass of the last prompt row per layer

    def __post_init__(self) -> None:
        self.recorded_layers = self.layers.fixed(self.num_layers) if self.tier >= 2 else ()

    def records(self, layer: int, partial_prefill: bool) -> bool:
        """True when layer ``layer`` records this forward (never in a prefill chunk that does not complete
        the region; before ``auto`` chooses: every layer)."""
        if self.tier < 2 or partial_prefill:
            return False
        return self.recorded_layers is None or layer in self.recorded_layers

    def new_step(self, seen: int) -> None:
        """Tier 3: a forward that records begins; its vector covers ``seen`` positions."""
        self.step_vectors.append(torch.zeros(self.num_layers, seen, dtype=torch.float16))

    def add_row(self, layer: int, cache_layer: SparseLayer, last_row: torch.Tensor, choosing_layer: bool) -> None:
        """Add the newest row's attention ``[b, heads, n]`` over ``cache_layer``'s slots, weighed by the mode;
        ``choosing_layer`` (the forward that completes the context): note its top-k mass for ``auto``."""
        positions = cache_layer.positions
        assert positions is not None
        attention = group_mean(last_row, self.kv_heads)[0]
        if self.mode == "attention" and self.head_weights is None:
            self.add(layer, cache_layer.seen, positions[0], attention)
        else:
            weights = None if self.head_weights is None else self.head_weights[layer]
            scored = score_row(weight_heads(last_row, weights), cache_layer.norms, self.kv_heads)[0]
            self.add(layer, cache_layer.seen, positions[0], scored, attention)
        if self.recorded_layers is None and choosing_layer:
            self.layer_mass[layer] = topk_mass(last_row, self.auto_k)

    def add_split(self, layer: int, cache_layer: SparseLayer, signal: torch.Tensor) -> None:
        """A layer split per KV head: add the newest row's attention ``signal`` ``[1, 1, capacity]`` (each slot's
        from its KV group, 0 on free slots); ``output`` and ``learned`` use group means here."""
        regions = cache_layer.regions
        assert regions is not None
        where, attention = regions.live_values(regions.pos), regions.live_values(signal)
        if (self.mode == "attention" or regions.norm is None) and self.head_weights is None:
            self.add(layer, cache_layer.seen, where, attention)
            return
        scored = attention
        if regions.norm is not None:
            scored = scored * regions.live_values(regions.norm.mean(dim=-1))
        if self.head_weights is not None:
            group = self.head_weights[layer].view(self.kv_heads, -1).mean(dim=-1)
            scored = scored * regions.live_values(group.to(regions.owner.device)[regions.owner])
        self.add(layer, cache_layer.seen, where, scored, attention)

    def add(self, layer: int, seen: int, positions: torch.Tensor, per_slot: torch.Tensor,
            attention: torch.Tensor | None = None) -> None:
        """Add the newest row's score to layer ``layer``'s totals (the layer has seen ``seen`` tokens).

        ``per_slot`` (any shape, the KV groups' mean) is the score each slot at ``positions`` (same
        shape) got; ``attention`` (same shape, not in ``attention`` mode) the plain attention, kept for
        the sink rule.
        """
        where = positions.reshape(-1).cpu()
        row = per_slot.float().reshape(-1).cpu() / self.kv_heads
        self.total = self._grown(self.total, seen)
        self.total[layer].index_add_(0, where, row)
        if attention is not None:
            self.attention = self._grown(self.attention, seen)
            self.attention[layer].index_add_(0, where, attention.float().reshape(-1).cpu() / self.kv_heads)
        if self.tier >= 3:
            vector = torch.zeros(seen, dtype=torch.float32).index_add_(0, where, row)
            self.step_vectors[-1][layer, :seen] = vector.to(torch.float16)

    def _grown(self, total: torch.Tensor | None, seen: int) -> torch.Tensor:
        """``total`` ``[layers, >= seen]``, reallocated (doubling) when shorter."""
        if total is None or total.shape[1] < seen:
            grown = torch.zeros(self.num_layers, max(seen, 2 * (0 if total is None else total.shape[1])))
            if total is not None:
                grown[:, : total.shape[1]] = total
            total = grown
        return total

    def choose_layer(self) -> None:
        """``auto``: keep the layer with the highest top-k mass (ties: the lower layer); drop the others' records."""
        if not self.layer_mass:
            return
        chosen = max(sorted(self.layer_mass), key=lambda layer: self.layer_mass[layer])
        self.recorded_layers = (chosen,)
        others = [layer for layer in range(self.num_layers) if layer != chosen]
        for total in (self.total, self.attention):
            if total is not None:
                total[others] = 0
        for vector in self.step_vectors:
            vector[others] = 0
