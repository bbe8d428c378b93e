"""``kvzap``: KVzap (Jegou et al., 2026, arXiv 2601.07891; kvpress's ``KVzapPress``): KVzip at prefill cost.

A surrogate per layer (:mod:`sparseety.policies.parts.kvzap_model`, linear or a two-layer MLP) reads the
hidden states that enter the layer's attention block and predicts, per token and KV head, the log
KVzip+ score the token would get from KVzip's reconstruction pass (``sparseety learn-policy --target
kvzip`` trains it). No extra pass: a token is scored once, when it is written, so decoding evicts too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparseety.errors import ConfigError
from sparseety.policies.base import (ModelInfo, Observation, Policy, Signal, check_positive_int, protect, recent_mask,
                                     share_heads, share_layers)
from sparseety.policies.parts.kvzap_model import SURROGATES, TRAIN_HINT, Surrogate, load_surrogate
from sparseety.policies.parts.learned_model import check_trained_for, shipped_file


@dataclass
class KVzapPolicy(Policy):
    """Keep the slots whose predicted log KVzip+ score is highest (``--budget``/``--ratio``) or above ``threshold``.

    Every slot keeps the score its token got when it was written (the policy's per-slot state, compacted
    with the cache). The first ``sinks`` positions are always kept; the newest ``window`` positions are
    kept while decoding, and in threshold mode at prefill too (DMS-style).

    Budget mode (``--budget``/``--ratio``): every layer keeps the budget; with ``share=true per_head=false`` the layers
    share their summed budget, as one threshold over all of them would: at the prefill that completes the prompt (or the
    long-document context) every layer is scored first, then the cut falls where threshold mode would
    place it so that the kept slots add up to the budgets' sum. A layer's count is the most slots any of
    its heads keeps (the layer's rank-``j`` score is its heads' best ``j``-th score); from then on each
    layer keeps its own count. KVzip+ scores are normalised (attention x ``||W_O v||`` / ``||x||``), so
    one cut across layers is meaningful, as in KVzap's DMS thresholding. Off by default: it finds
    RULER's needles that uniform budgets lose, but the counts can be very uneven (one layer 9 slots,
    another all 389) and a short pass-key prompt then loses its key (docs/policies.md).

    ``per_head`` (budget mode; on by default) gives each KV head its own count: at the same prefill the heads
    of a layer share its budget by score (one ranking over the layer's (head, slot) scores; with ``share=true``
    over every layer's), each head's best slot first; the layer is then stored per KV head, as ``kvzip`` stores
    it, and a decoded token's slot in head ``k`` takes the surrogate's score for head ``k``. Uniform budgets
    lose RULER's needles that per-head counts find (docs/policies.md); ``per_head=false`` gives every head
    the layer's count (and with ``share=true`` the per-layer sharing above, with its ``floor``).

    Threshold mode (``threshold=T``, no budget): after each step every KV head of a layer keeps the same
    count, the most slots any of its heads scores at ``T`` or above (protected slots included), so a
    slot below ``T`` is evicted unless its layer's busiest head needs the room. ``max_kept=N`` caps that
    count; admission reserves ``N`` slots per layer, or the dense size without a cap. The kept fraction
    of each layer (slots held / tokens seen at the end) is recorded in the trace as ``kept_fraction``.

    ``model`` names a surrogate file; without it the one shipped for the run's model (by fingerprint,
    ``policies/weights/kvzap-<surrogate>-<model>.safetensors``) is used. A file trained for another
    model is refused.

    Shapes: ``hidden`` ``[b, r, D]`` (the last ``r`` slots' tokens); scores and state ``[b, kv_heads, n]``.
    """

    name: ClassVar[str] = "kvzap"
    summary: ClassVar[str] = "a per-layer surrogate on the hidden states predicts KVzip+ scores, no extra pass (KVzap)"
    prefill_signal: ClassVar[Signal] = Signal.NONE
    decode_signal: ClassVar[Signal] = Signal.NONE
    needs_hidden: ClassVar[bool] = True
    reads_keys: ClassVar[bool] = False

    model: str = ""
    surrogate: str = "linear"
    threshold: float | None = None
    max_kept: int = 0
    sinks: int = 4
    window: int = 32
    share: bool = False
    floor: float = 0.0
    per_head: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._surrogate: Surrogate | None = None  # not a dataclass field: not an option
        self._source = self.model
        if self.surrogate not in SURROGATES:
            raise ConfigError(f"kvzap: surrogate must be one of {', '.join(SURROGATES)}, got {self.surrogate!r}")
        if isinstance(self.threshold, str):
            try:
                self.threshold = float(self.threshold) if self.threshold.strip() else None
            except ValueError:
                raise ConfigError(f"kvzap: threshold must be a number (a log KVzip+ score, e.g. -4), "
                                  f"got {self.threshold!r}") from None
        if self.threshold is not None and (not isinstance(self.threshold, (int, float)) or isinstance(self.threshold, bool)
                                           or not math.isfinite(self.threshold)):
            raise ConfigError(f"kvzap: threshold must be a finite number (a log KVzip+ score, e.g. -4), "
                              f"got {self.threshold!r}")
        check_positive_int(self.name, "max_kept", self.max_kept, minimum=0)
        check_positive_int(self.name, "sinks", self.sinks, minimum=0)
        check_positive_int(self.name, "window", self.window, minimum=0)
        for flag in ("share", "per_head"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"kvzap: {flag} must be true or false, got {getattr(self, flag)!r}")
        given = self.floor
        try:
            self.floor = float(given)
        except (TypeError, ValueError):
            self.floor = float("nan")
        if isinstance(given, bool) or not 0.0 <= self.floor <= 1.0:
            raise ConfigError(f"kvzap: floor must be a number from 0 to 1 (the share of its budget every layer "
                              f"keeps under share=true per_head=false), got {given!r}")
        if self.threshold is not None and (self.share or self.floor):
            given = " and ".join(f"{k}={v}" for k, v in (("share", "true"), ("floor", self.floor))
                                 if (k == "share" and self.share) or (k == "floor" and self.floor))
            raise ConfigError(f"kvzap: {given} does nothing in threshold mode (threshold={self.threshold:g}): share "
                              "and floor divide a budget; drop them, or give a budget instead of threshold=")
        if self.floor and (self.per_head or not self.share):
            mode = "per_head=true (the default)" if self.per_head else "share=false"
            raise ConfigError(f"kvzap: floor={self.floor:g} does nothing under {mode}: floor is the share of its "
                              "budget every layer keeps when the layers share theirs (share=true per_head=false)")
        if self.threshold is not None and self.budget is not None:
            raise ConfigError("kvzap: give either threshold= or a budget (--budget/--ratio), not both; cap a "
                              "threshold run with max_kept=N")
        if self.threshold is None and self.max_kept:
            raise ConfigError("kvzap: max_kept caps a threshold run; with a budget, the budget is the cap")
        if self.model:
            self._surrogate = load_surrogate(self.model)
            self._check_kind(self._surrogate, self.model)

    @classmethod
    def needs_budget(cls, options: dict[str, Any]) -> bool:
        return options.get("threshold") in (None, "")

    def params(self) -> dict[str, object]:
        out: dict[str, object] = {"model": self.model, "surrogate": self.surrogate, "threshold": self.threshold,
                                  "max_kept": self.max_kept, "sinks": self.sinks, "window": self.window,
                                  "share": self.share, "floor": self.floor, "per_head": self.per_head}
        if self._surrogate is not None:
            out["surrogate_file"] = self._source
            out["trained_for"] = self._surrogate.model
            out["model_fingerprint"] = self._surrogate.model_fingerprint
        return out

    def _check_kind(self, surrogate: Surrogate, source: str) -> None:
        if surrogate.kind != self.surrogate:
            raise ConfigError(f"kvzap: {source} holds a {surrogate.kind} surrogate, but surrogate={self.surrogate}")

    def bind(self, model: ModelInfo) -> None:
        """Use the shipped surrogate of ``model`` when none was given; refuse one trained for another model."""
        if not self.model:
            path = shipped_file(f"kvzap-{self.surrogate}-", model)
            if path is None:
                raise ConfigError(f"kvzap: no surrogate file given, and no {self.surrogate} surrogate ships for "
                                  f"model {model.name!r} (fingerprint {model.fingerprint()}); pass --policy-opt "
                                  f"model=FILE (written by `{TRAIN_HINT}`)")
            self._surrogate, self._source = load_surrogate(path), f"the shipped {path.name}"
        surrogate = self.surrogate_model
        check_trained_for("kvzap", self._source, surrogate.model, surrogate.model_fingerprint, model)
        if (surrogate.num_layers, surrogate.kv_heads) != (model.num_layers, model.kv_heads):
            raise ConfigError(f"kvzap: {self._source} has {surrogate.num_layers} layers x {surrogate.kv_heads} KV "
                              f"heads, the model {model.num_layers} x {model.kv_heads}")

    @property
    def surrogate_model(self) -> Surrogate:
        if self._surrogate is None:
            raise ConfigError(f"kvzap: no surrogate loaded (the policy is bound to a model first); pass --policy-opt "
                              f"model=FILE (written by `{TRAIN_HINT}`)")
        return self._surrogate

    @property
    def splits_heads(self) -> bool:
        return self.per_head and self.threshold is None

    @property
    def shares_budget(self) -> bool:
        return (self.share or self.per_head) and self.threshold is None

    def allocate(self, scores: dict[int, torch.Tensor], budgets: dict[int, int]) -> dict[int, int | list[int]]:
        """The counts (see the class docstring) for the layers of ``scores`` (``[b, kv_heads, n]`` each):
        ``per_head``: per layer one count per KV head (its heads share its budget, or with ``share`` every
        layer's heads share the sum); else per layer one count, the budgets' sum shared by the layers' rank
        scores (per rank, the best of the heads' scores at that rank)."""
        if self.per_head and scores:
            return share_heads(scores, budgets, across_layers=self.share)
        if len(scores) < 2:
            return dict(budgets)
        return dict(share_layers(scores, budgets, lambda ranked: ranked.amax(dim=(0, 1)), self.floor))

    def layer_budget(self, layer: int, num_layers: int, seen: int | None = None) -> int | None:
        return self.budget if self.threshold is None else (self.max_kept or None)

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = obs.positions.shape[-1]
        state = obs.state.clone() if obs.state is not None else torch.zeros(obs.positions.shape, device=obs.positions.device)
        # a layer stored per KV head is one row, so every head's newest position is the row's
        newest = None if obs.owners is None else int(obs.positions.amax())
        if obs.hidden is not None and obs.hidden.shape[1]:
            rows = obs.hidden[:, -n:]
            surrogate = self.surrogate_model
            if rows.shape[-1] != surrogate.hidden_size:
                raise ConfigError(f"kvzap: the surrogate reads hidden size {surrogate.hidden_size}, the model's "
                                  f"layer {obs.layer} gives {rows.shape[-1]}")
            predicted = surrogate(obs.layer, rows)  # [b, kv_heads, r]
            if newest is None:
                state[..., n - rows.shape[1]:] = predicted
            else:  # each head's new slots are its last live ones, head after head
                state.masked_scatter_(obs.positions > newest - rows.shape[1], predicted)
        protected = obs.positions < self.sinks
        window = self.window if self.threshold is not None else 0 if obs.prefill else min(self.window, self.budget or 0)
        if window:  # a threshold keeps its recent window; a budget, as kvzip, never cuts the answer being written
            protected |= recent_mask(obs.positions, window) if newest is None else obs.positions > newest - window
        return protect(state, protected), state

    def keep_count(self, scores: torch.Tensor) -> int | None:
        if self.threshold is None:
            return None
        return max(1, int((scores >= self.threshold).sum(dim=-1).amax()))
