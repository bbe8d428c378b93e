"""Token pruning at run time: drop prompt rows between decoder layers and remember which rows each layer computed.

A forward pre-hook on every decoder layer (registered once per model, :func:`install_layer_hooks`)
hands the layer's inputs to the active run's :class:`PruneRun`. After a pruning layer ``L`` the hook
of layer ``L + 1`` ranks the remaining prompt rows by the attention the last prompt row(s) paid to
them at layer ``L`` and slices ``hidden_states`` ``[b, q, d]`` to the kept rows; every later layer
then gets its per-token inputs (``position_embeddings`` ``(cos, sin)`` ``[b, q, d]``, ``position_ids``
``[b, q]``, ``cache_position`` ``[q]``) sliced the same way, and its cache layer is told which
original positions the new rows carry (:meth:`SparseLayer.expect`), while the tokens *seen* still
advance by the whole forward. Only the first forward of a run is pruned, and only if it is a prompt forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparseety.engine.cache import SparseLayer
from sparseety.policies.base import select_keep
from sparseety.prune_schedule import PruneSchedule, prune_count

_HOOKED = "_sparseety_layer_hooks"
_ROW_KWARGS = ("position_ids",)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` for Llama, Qwen2, Mixtral...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


@dataclass
class PruneRun:
    """Pruning state of one run: the schedule, the rows alive in the pruned forward and what was pruned.

    Parameters
    ----------
    schedule : the pruning schedule.
    num_layers : decoder layers of the model.
    """

    schedule: PruneSchedule
    num_layers: int
    active: bool = False  #: the forward in progress is the pruned one
    q_full: int = 0  #: rows fed to the pruned forward
    base: int = 0  #: tokens seen before it (position of its row 0)
    drafts: int = 0  #: speculative drafts fed after the prompt in that forward (never scored, never pruned)
    rows: torch.Tensor | None = None  #: ``[r]`` indices (into the forward's rows) still alive; None = all
    pending: torch.Tensor | None = None  #: ``[r]`` row scores from the last pruning layer, not yet applied
    layer_tokens: list[int] = field(default_factory=list)  #: prompt rows each layer computed
    layer_rows: dict[int, torch.Tensor] = field(default_factory=dict)  #: rows of layers that computed fewer
    events: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  #: (layer, positions, scores)
    done: bool = False

    def begin(self, q_len: int, seen: int, prunable: bool, drafts: int = 0) -> None:
        """Start a forward of ``q_len`` rows (the last ``drafts`` of them speculative drafts) after ``seen``
        tokens; only the first prunable forward is pruned."""
        self.active = prunable and not self.done
        if self.active:
            self.done = True
            self.q_full, self.base, self.drafts = q_len, seen, drafts
            self.rows, self.pending = None, None
            self.layer_tokens = [q_len] * self.num_layers

    def end(self) -> None:
        """End of a forward."""
        self.active = False

    def score_rows(self, layer: int) -> int:
        """Query rows layer ``layer`` must hand to :meth:`take_scores` (0: none)."""
        return self.schedule.window if self.active and self.schedule.fraction_after(layer) is not None else 0

    def take_scores(self, probs: torch.Tensor) -> None:
        """Row scores from ``probs`` ``[b, heads, w, n]``: the probabilities of the last ``w`` prompt rows over
        the ``n`` slots they see (this forward's prompt rows are the last of those slots; drafts score 0)."""
        q = (self.q_full if self.rows is None else self.rows.numel()) - self.drafts
        n = probs.shape[-1]
        scores = probs[0, :, :, n - q:].float().mean(dim=(0, 1)).cpu()
        self.pending = torch.cat([scores, scores.new_zeros(self.drafts)])

    def before_layer(self, layer: int, args: tuple, kwargs: dict[str, Any],
                     cache_layer: SparseLayer | None) -> tuple[tuple, dict[str, Any]] | None:
        """Prune after the previous layer if it is a pruning point, then slice this layer's per-token inputs."""
        if not self.active:
            return None
        changed = False
        if self.pending is not None:
            fraction = self.schedule.fraction_after(layer - 1)
            assert fraction is not None
            keep = self._prune(layer - 1, fraction, self.pending)
            self.pending = None
            if keep is not None:
                if args:
                    args = (args[0][:, keep.to(args[0].device)], *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": kwargs["hidden_states"][:, keep.to(kwargs["hidden_states"].device)]}
                changed = True
        if self.rows is None:
            return (args, kwargs) if changed else None
        rows = self.rows
        kwargs = dict(kwargs)
        if kwargs.get("position_embeddings") is not None:
            kwargs["position_embeddings"] = tuple(t[:, rows.to(t.device)] for t in kwargs["position_embeddings"])
        for name in _ROW_KWARGS:
            if isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].shape[-1] == self.q_full:
                kwargs[name] = kwargs[name][..., rows.to(kwargs[name].device)]
        if isinstance(kwargs.get("cache_position"), torch.Tensor):
            kwargs["cache_position"] = kwargs["cache_position"][rows.to(kwargs["cache_position"].device)]
        if cache_layer is not None:
            cache_layer.expect(self.base + rows, self.q_full)
        self.layer_tokens[layer] = rows.numel()
        self.layer_rows[layer] = rows
        return args, kwargs

    def _prune(self, layer: int, fraction: float, scores: torch.Tensor) -> torch.Tensor | None:
        """Drop the lowest-scored unprotected rows; returns the kept indices into the current rows (None: nothing dropped)."""
        rows = torch.arange(self.q_full) if self.rows is None else self.rows
        r = rows.numel()
        positions = self.base + rows
        prompt_end = self.q_full - self.drafts
        protected = (positions < self.schedule.sinks) | (rows >= prompt_end - max(1, self.schedule.keep_recent))
        count = min(prune_count(fraction, r - self.drafts), r - int(protected.sum()))
        if count <= 0:
            return None
        ranked = scores.masked_fill(protected, float("inf"))
        keep = select_keep(ranked.view(1, 1, r), r - count)[0, 0]
        dropped = torch.ones(r, dtype=torch.bool)
        dropped[keep] = False
        self.events.append((layer, positions[dropped], scores[dropped]))
        self.rows = rows[keep]
        return keep

    def pruned_positions(self) -> int:
        """Distinct positions pruned."""
        return sum(int(p.numel()) for _, p, _ in self.events)

    def to_arrays(self, token_ids: np.ndarray) -> dict[str, np.ndarray]:
        """``pruned.{step,layer,kv_head,position,token_id,score}`` (step 0, kv_head -1) and ``layer_tokens`` ``[layers]``."""
        positions = np.concatenate([p.numpy() for _, p, _ in self.events]).astype(np.int64) if self.events \
            else np.zeros(0, dtype=np.int64)
        layers = np.concatenate([np.full(p.numel(), layer, dtype=np.int64) for layer, p, _ in self.events]) \
            if self.events else np.zeros(0, dtype=np.int64)
        scores = np.concatenate([s.numpy() for _, _, s in self.events]).astype(np.float32) if self.events \
            else np.zeros(0, dtype=np.float32)
        return {
            "pruned.step": np.zeros_like(positions),
            "pruned.layer": layers,
            "pruned.kv_head": np.full_like(positions, -1),
            "pruned.position": positions,
            "pruned.token_id": token_ids[positions],
            "pruned.score": scores,
            "layer_tokens": np.asarray(self.layer_tokens or [0] * self.num_layers, dtype=np.int64),
        }

    def expand(self, layer: int, values: np.ndarray, fill: float = np.nan) -> np.ndarray:
        """Re-align a per-layer, per-fed-row array ``[rows_fed, ...]`` to every fed token, ``fill`` where pruned.

        Probes record one entry per row a layer computed, forward after forward; the pruned forward
        is the first, so its rows come first.
        """
        rows = self.layer_rows.get(layer)
        if rows is None:
            return values
        r = rows.numel()
        out = np.full((values.shape[0] - r + self.q_full, *values.shape[1:]), fill, dtype=np.float32)
        out[rows.numpy()] = values[:r]
        out[self.q_full:] = values[r:]
        return out


def install_layer_hooks(model: torch.nn.Module, active_prune: Callable[[], tuple[PruneRun, Any] | None]) -> None:
    """Register, once per model, a pre-hook on each decoder layer forwarding to the active run's :class:`PruneRun`.

    ``active_prune()`` returns ``(prune_run, cache)`` of the run in progress, or None.
    """
    if getattr(model, _HOOKED, False):
        return
    for index, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(_layer_hook(index, active_prune), with_kwargs=True)
    setattr(model, _HOOKED, True)


def _layer_hook(index: int, active_prune: Callable[[], tuple[PruneRun, Any] | None]):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        found = active_prune()
        if found is None:
            return None
        prune, cache = found
        layers = getattr(cache, "layers", None)
        return prune.before_layer(index, args, kwargs, layers[index] if layers is not None else None)
    return hook
