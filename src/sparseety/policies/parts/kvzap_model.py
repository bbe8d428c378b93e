"""The ``kvzap`` policy's surrogate: per layer a linear model (or a two-layer MLP) from the hidden states
entering the attention block to one predicted log KVzip+ score per KV head, in one safetensors file.

Tensors (``L`` layers, ``D`` hidden size, ``H`` MLP width, ``0`` for the linear surrogate, ``K`` KV heads):
``w1`` ``[L, D, H]``, ``b1`` ``[L, H]``, ``w2`` ``[L, D or H, K]``, ``b2`` ``[L, K]``. A layer scores
``x @ w2 + b2`` (linear) or ``gelu(x @ w1 + b1) @ w2 + b2`` (MLP), as kvpress's ``KVzapModel``. Metadata
(strings): ``format``, ``format_version``, ``model``, ``model_fingerprint``, ``surrogate`` (``linear`` or
``mlp``) and ``provenance`` (JSON: text, target, held-out fidelity). Read with the one loader of trained
policy files (:func:`sparseety.policies.parts.learned_model.read_weights`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparseety.errors import ConfigError
from sparseety.policies.parts.learned_model import cached, read_weights

FORMAT = "sparseety-kvzap-surrogate"
FORMAT_VERSION = "1"
SURROGATES = ("linear", "mlp")
_TENSORS = ("w1", "b1", "w2", "b2")
TRAIN_HINT = "sparseety learn-policy TRACE_DIR --target kvzip -o FILE"


@dataclass
class Surrogate:
    """Weights of every layer, the model they were trained for, and their provenance."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    model: str
    model_fingerprint: str
    provenance: dict[str, Any] = field(default_factory=dict)
    #: per (layer, device): ``(w1, b1, w2, b2)`` laid out for ``linear`` (``[out, in]``), made on first use
    _laid_out: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    @property
    def kind(self) -> str:
        return "mlp" if self.w1.shape[-1] else "linear"

    @property
    def num_layers(self) -> int:
        return int(self.w2.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w1.shape[1])

    @property
    def kv_heads(self) -> int:
        return int(self.w2.shape[-1])

    def __call__(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted scores ``[b, kv_heads, r]`` (float32) of hidden states ``[b, r, D]`` of layer ``layer``."""
        weights = self._laid_out.get((layer, hidden.device))
        if weights is None:
            weights = self._laid_out[layer, hidden.device] = tuple(
                w.to(hidden.device).t().contiguous() if w.dim() == 2 else w.to(hidden.device)
                for w in (self.w1[layer], self.b1[layer], self.w2[layer], self.b2[layer]))
        w1, b1, w2, b2 = weights
        x = hidden.float()
        if w1.shape[0]:
            x = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
        return torch.nn.functional.linear(x, w2, b2).transpose(1, 2)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).float().contiguous() for name in _TENSORS}

    def metadata(self) -> dict[str, str]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "model": self.model,
                "model_fingerprint": self.model_fingerprint, "surrogate": self.kind,
                "provenance": json.dumps(self.provenance, sort_keys=True)}

    def save(self, path: str | Path) -> Path:
        """Write the file (via a temporary name, renamed into place)."""
        from safetensors.torch import save_file

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        save_file(self.tensors(), str(tmp), metadata=self.metadata())
        tmp.replace(target)
        return target


def read_surrogate(path: str | Path) -> Surrogate:
    """Read and check a surrogate file.

    Raises
    ------
    ConfigError
        As :func:`read_weights`; damaged metadata, misshapen or non-finite weights.
    """
    source = Path(path)
    meta, t = read_weights(source, "kvzap", FORMAT, FORMAT_VERSION, _TENSORS, TRAIN_HINT)
    try:
        provenance = json.loads(meta.get("provenance") or "{}")
    except ValueError as exc:
        raise ConfigError(f"kvzap: {source} has damaged metadata ({exc})") from None
    w1, b1, w2, b2 = (t[name] for name in _TENSORS)
    ok = w1.dim() == 3 and b1.dim() == 2 and w2.dim() == 3 and b2.dim() == 2
    if ok:
        layers, d, h = w1.shape
        k = w2.shape[-1]
        ok = b1.shape == (layers, h) and w2.shape == (layers, h or d, k) and b2.shape == (layers, k)
    if not ok:
        raise ConfigError(f"kvzap: {source}: tensors w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)}, w2 {tuple(w2.shape)}, "
                          f"b2 {tuple(b2.shape)} are not [L, D, H], [L, H], [L, D or H, K], [L, K]")
    if not all(torch.isfinite(x).all() for x in (w1, b1, w2, b2)):
        raise ConfigError(f"kvzap: {source}: weights are not all finite")
    surrogate = Surrogate(w1=w1.float(), b1=b1.float(), w2=w2.float(), b2=b2.float(), model=meta["model"],
                          model_fingerprint=meta["model_fingerprint"], provenance=provenance)
    if meta.get("surrogate") != surrogate.kind:
        raise ConfigError(f"kvzap: {source} says surrogate {meta.get('surrogate')!r} but holds a {surrogate.kind} one")
    return surrogate


def load_surrogate(path: str | Path) -> Surrogate:
    """:func:`read_surrogate`, cached per file (path, size and modification time)."""
    return cached(path, read_surrogate)
