"""``learned``: evict by a predictor trained on SparSEEty's own tier-3 traces (``sparseety learn-policy``).

No single paper: a tiny supervised model of the attention a slot receives from later steps (the label
of :mod:`sparseety.training.learned_policy`), over features the engine has at eviction time; the
direction issue 15 names. Its training data, held-out figures and text sources are in the README.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseety.errors import ConfigError
from sparseety.policies.base import ModelInfo, Observation, Policy, Signal
from sparseety.policies.parts.learned_features import attention_share, feature_names, slot_features
from sparseety.policies.parts.learned_model import Predictor, check_trained_for, load_predictor, shipped_file

HEAD_MODES = ("layer", "kv_head")


@dataclass
class LearnedPolicy(Policy):
    """Keep the slots a trained predictor expects later steps to attend to most; evicts while decoding.

    Every step (the prompt's, or the context's, last row at prefill, each decode row after) the slots of
    a layer are scored by the predictor of ``model`` (a file written by ``sparseety learn-policy``) from
    the features of :mod:`sparseety.policies.parts.learned_features`: position, recency, key norm, the
    attention the newest query gives the slot and the most it ever received, token class, layer and KV
    head. ``heads="layer"`` averages the scores over the layer's KV heads, so every KV head keeps one
    shared set (as ``tova`` does by default); ``heads="kv_head"`` lets every KV head keep its own.

    The file names the model it was trained for and a fingerprint of that model's config and weights;
    running it on another model, or on a model with another geometry, is refused with a
    :class:`ConfigError`. Without ``model`` the predictor shipped for the run's model is used (one ships
    for each built-in model, ``policies/weights/learned-<model>.safetensors``, picked by fingerprint).

    Shapes: ``positions``/``attention``/scores ``[b, kv_heads, n]``, ``keys`` ``[b, kv_heads, n, d]``.
    """

    name: ClassVar[str] = "learned"
    summary: ClassVar[str] = "a predictor trained on tier-3 traces (sparseety learn-policy) scores every slot"
    prefill_signal: ClassVar[Signal] = Signal.LAST_ROW
    decode_signal: ClassVar[Signal] = Signal.LAST_ROW
    needs_token_ids: ClassVar[bool] = True

    model: str = ""
    heads: str = "layer"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._predictor: Predictor | None = None  # not a dataclass field: not an option
        if self.heads not in HEAD_MODES:
            raise ConfigError(f"learned: heads must be one of {', '.join(HEAD_MODES)}, got {self.heads!r}")
        if self.model:
            self._predictor = load_predictor(self.model)

    def params(self) -> dict[str, object]:
        out: dict[str, object] = {"model": self.model, "heads": self.heads}
        if self._predictor is not None:
            out["trained_for"] = self._predictor.model
            out["model_fingerprint"] = self._predictor.model_fingerprint
        return out

    @property
    def predictor(self) -> Predictor:
        if self._predictor is None:
            raise ConfigError("learned: no predictor file given; pass --policy-opt model=policy.safetensors "
                              "(written by `sparseety learn-policy TRACE_DIR -o policy.safetensors`)")
        return self._predictor

    def bind(self, model: ModelInfo) -> None:
        """Use the shipped predictor of ``model`` when none was given; refuse a predictor trained for another
        model (by fingerprint) or with another feature set."""
        source = self.model
        if not self.model:
            path = shipped_file("learned-", model)
            if path is None:
                raise ConfigError(f"learned: no predictor file given, and none ships for model {model.name!r} "
                                  f"(fingerprint {model.fingerprint()}); pass --policy-opt model=policy.safetensors "
                                  "(written by `sparseety learn-policy TRACE_DIR -o policy.safetensors`)")
            self._predictor, source = load_predictor(path), f"the shipped {path.name}"
        predictor = self.predictor
        check_trained_for("learned", source, predictor.model, predictor.model_fingerprint, model)
        expected = feature_names(model.num_layers, model.kv_heads)
        if predictor.features != expected:
            extra = sorted(set(predictor.features) - set(expected))
            lacking = sorted(set(expected) - set(predictor.features))
            raise ConfigError(f"learned: {source} has another feature set than this version computes "
                              f"({len(predictor.features)} features, expected {len(expected)}; unknown: "
                              f"{extra[:5] or 'none'}, missing: {lacking[:5] or 'none'})")

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert obs.attention is not None
        predictor = self.predictor
        share = attention_share(obs.attention)
        share_max = share if obs.state is None else torch.maximum(obs.state, share)
        x = slot_features(obs.positions, obs.keys, obs.attention, share_max, obs.token_ids,
                          predictor.token_class, obs.layer, obs.num_layers)
        scores = predictor(x)
        if self.heads == "layer":
            scores = scores.mean(dim=1, keepdim=True).expand_as(share)
        return scores, share_max
