"""``RunSettings``: what one run was asked, fixed for the run (the configuration part of the run context).

The engine builds it once per request from the frozen :class:`~sparseety.options.GenerationOptions`
(held whole) and what it derives from them for this model and this input: the policy with its budget
resolved, the model's geometry, the parsed layer selection and the importance feature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparseety.engine.layers import LayerSelection
from sparseety.options import GenerationOptions, ImportanceMode
from sparseety.policies.base import Policy


@dataclass
class RunSettings:
    """What one traced generation was asked.

    Parameters
    ----------
    options : the run's options, whole (tier, seed, top-k, ``attention_topk``, pruning text, ...).
    policy : the KV policy, its budget resolved on this input and bound to the model.
    num_layers, kv_heads : model geometry.
    input_len : tokens fed before generation starts (prompt, or context plus question). Teacher forcing
        sets it to the context's length while it prefills a long document's context alone.
    compress_len : the long-document protocol (evict only at the end of the context; the question and
        answer are never compressed): the context length, the prompt's first ``compress_len`` tokens.
        None: a plain prompt.
    layers : which layers record importance (tier >= 2): all, a list, or ``auto`` (the layer with the
        highest top-``auto_k`` mass of the last prompt row, chosen after the first forward).
    importance_mode : the feature importance weighs attention by (``options.importance``, or for
        ``learned`` the feature its head weights were fitted on).
    out_grams : ``output`` mode: per layer ``[kv_heads, g, d, d]`` W_O Gram matrices, else None.
    head_weights : ``learned``: ``[layers, heads]`` weights of each head's score, else None.
    on_prefill_layer : called with ``(layer, num_layers)`` as a prefill passes each layer.

    ``tier``, ``seed``, ``auto_k`` (``options.top_k``) and ``attention_topk`` are copied from ``options``
    as plain attributes: the per-layer hot path reads them.
    """

    options: GenerationOptions
    policy: Policy
    num_layers: int
    kv_heads: int
    input_len: int
    compress_len: int | None = None
    layers: LayerSelection = field(default_factory=LayerSelection)
    importance_mode: ImportanceMode = "attention"
    out_grams: list[torch.Tensor] | None = None
    head_weights: torch.Tensor | None = None
    on_prefill_layer: Callable[[int, int], None] | None = None
    tier: int = field(init=False)
    seed: int = field(init=False)
    auto_k: int = field(init=False)
    attention_topk: int | None = field(init=False)

    def __post_init__(self) -> None:
        options = self.options
        self.tier, self.seed, self.auto_k = options.tier, options.seed, options.top_k
        self.attention_topk = options.attention_topk
        if self.importance_mode == "output" and self.tier >= 2 and (
                self.out_grams is None or len(self.out_grams) != self.num_layers):
            raise ValueError("importance 'output' needs the output projection's Gram matrices of every layer")

    @property
    def compress_once(self) -> bool:
        """The long-document protocol: only the context (the first ``compress_len`` tokens) is compressed."""
        return self.compress_len is not None
