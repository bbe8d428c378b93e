"""The ``learned`` policy's predictor: a tiny MLP (or a logistic model) over slot features, in one safetensors file.

Tensors: ``mean``, ``std`` (``[F]`` feature standardization), ``w1`` ``[F, H]``, ``b1`` ``[H]``, ``w2``
``[H]``, ``b2`` ``[1]`` (``H = 0``: no hidden layer, ``w2`` is ``[F]``), and ``token_class`` (``[vocab]``
int8, the class of every token id). Metadata (strings): ``format``, ``format_version``, ``model``,
``model_fingerprint``, ``features`` (JSON list), ``hidden`` and ``provenance`` (JSON: how and on what it
was trained, with its held-out metrics).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from sparseety.errors import ConfigError
from sparseety.policies.base import ModelInfo

FORMAT = "sparseety-learned-policy"
FORMAT_VERSION = "1"
_TENSORS = ("mean", "std", "w1", "b1", "w2", "b2", "token_class")
#: Trained files that ship with the package (``learned-<model>``, ``kvzap-<surrogate>-<model>``).
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"  #: policies/weights/, the shipped files


@dataclass
class Predictor:
    """Weights, the features they expect, and where they come from."""

    mean: torch.Tensor
    std: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    token_class: torch.Tensor
    model: str
    model_fingerprint: str
    features: list[str]
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[-1]) if self.w1.numel() else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Scores ``[...]`` (logits, higher is kept) of features ``[..., F]``."""
        z = (x.float() - self.mean.to(x.device)) / self.std.to(x.device)
        if self.hidden:
            z = torch.relu(z @ self.w1.to(x.device) + self.b1.to(x.device))
        return z @ self.w2.to(x.device) + self.b2.to(x.device)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).contiguous() for name in _TENSORS}

    def metadata(self) -> dict[str, str]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "model": self.model,
                "model_fingerprint": self.model_fingerprint, "features": json.dumps(self.features),
                "hidden": str(self.hidden), "provenance": json.dumps(self.provenance, sort_keys=True)}

    def save(self, path: str | Path) -> Path:
        """Write the file (via a temporary name, renamed into place)."""
        from safetensors.torch import save_file

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        save_file(self.tensors(), str(tmp), metadata=self.metadata())
        tmp.replace(target)
        return target


def read_weights(path: str | Path, policy: str, fmt: str, version: str, required: Sequence[str],
                 train_hint: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read a trained policy's safetensors file: ``(metadata, tensors)``, checked for its format.

    The one loader of ``learned`` predictors and ``kvzap`` surrogates. ``policy`` prefixes every
    message, ``fmt``/``version`` are the expected ``format``/``format_version`` metadata, ``required``
    the tensors it must hold, ``train_hint`` the command that writes such a file.

    Raises
    ------
    ConfigError
        Missing file, not a safetensors file (or damaged), another format or version, missing tensors.
    """
    from safetensors import safe_open

    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"{policy}: predictor file {source} does not exist (train one with `{train_hint}`)")
    try:
        with safe_open(str(source), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:  # safetensors raises its own error types for torn or foreign files
        raise ConfigError(f"{policy}: {source} is not a readable predictor file (damaged or not safetensors: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if meta.get("format") != fmt:
        raise ConfigError(f"{policy}: {source} is not a {policy}-policy file (format {meta.get('format')!r}, "
                          f"expected {fmt!r})")
    if meta.get("format_version") != version:
        raise ConfigError(f"{policy}: {source} has format version {meta.get('format_version')!r}; this version "
                          f"reads {version!r}")
    missing = [name for name in required if name not in tensors]
    if missing:
        raise ConfigError(f"{policy}: {source} lacks tensors {', '.join(missing)}")
    for key in ("model", "model_fingerprint"):
        if key not in meta:
            raise ConfigError(f"{policy}: {source} has damaged metadata (no {key!r})")
    return meta, tensors


def check_trained_for(policy: str, source: str, model_name: str, fingerprint: str, model: ModelInfo) -> None:
    """Refuse a file trained for another model than ``model`` (by fingerprint of config and weights)."""
    actual = model.fingerprint()
    if actual != fingerprint:
        raise ConfigError(
            f"{policy}: {source} was trained for model {model_name!r} (fingerprint {fingerprint}), but this run "
            f"uses model {model.name!r} (fingerprint {actual}); train one for it with `sparseety learn-policy`")


def shipped_file(prefix: str, model: ModelInfo) -> Path | None:
    """The file shipped in :data:`WEIGHTS_DIR` named ``<prefix>*.safetensors`` trained for ``model`` (by
    fingerprint; only the metadata is read), or None."""
    from safetensors import safe_open

    if not WEIGHTS_DIR.is_dir():
        return None
    fingerprint = model.fingerprint()
    for path in sorted(WEIGHTS_DIR.glob(f"{prefix}*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("model_fingerprint") == fingerprint:
                return path
    return None


def read_predictor(path: str | Path) -> Predictor:
    """Read and check a ``learned`` predictor file (:func:`read_weights`, then its features and shapes).

    Raises
    ------
    ConfigError
        As :func:`read_weights`; damaged metadata, misshapen or non-finite tensors.
    """
    source = Path(path)
    meta, tensors = read_weights(source, "learned", FORMAT, FORMAT_VERSION, _TENSORS,
                                 "sparseety learn-policy TRACE_DIR -o FILE")
    try:
        features = json.loads(meta["features"])
        provenance = json.loads(meta.get("provenance") or "{}")
        model, fingerprint = meta["model"], meta["model_fingerprint"]
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"learned: {source} has damaged metadata ({exc})") from None
    predictor = Predictor(**{name: tensors[name] for name in _TENSORS}, model=model, model_fingerprint=fingerprint,
                          features=list(features), provenance=provenance)
    _check_shapes(source, predictor)
    return predictor


def _check_shapes(source: Path, p: Predictor) -> None:
    f = len(p.features)
    hidden = p.w1.shape[-1] if p.w1.dim() == 2 else -1
    expected = {"mean": (f,), "std": (f,), "w1": (f, hidden), "b1": (hidden,),
                "w2": (hidden,) if hidden > 0 else (f,), "b2": (1,)}
    for name, shape in expected.items():
        if tuple(getattr(p, name).shape) != shape or hidden < 0:
            raise ConfigError(f"learned: {source}: tensor {name} has shape {tuple(getattr(p, name).shape)}, "
                              f"expected {shape} for {f} features")
    if p.token_class.dim() != 1:
        raise ConfigError(f"learned: {source}: token_class must be one-dimensional")
    if not all(torch.isfinite(getattr(p, name)).all() for name in ("mean", "std", "w1", "b1", "w2", "b2")):
        raise ConfigError(f"learned: {source}: weights are not all finite")


_LOADED: dict[tuple[str, str, int, int], Any] = {}
_LOCK = threading.Lock()


def load_predictor(path: str | Path) -> Predictor:
    """:func:`read_predictor`, cached per file (path, size and modification time)."""
    return cached(path, read_predictor)


R = TypeVar("R")


def cached(path: str | Path, read: Callable[[Path], R]) -> R:
    """``read(path)``, cached per file (path, size and modification time)."""
    source = Path(path).expanduser()
    try:
        stat = source.stat()
    except OSError:
        return read(source)  # raises the missing-file error
    key = (read.__qualname__, str(source.resolve()), stat.st_size, stat.st_mtime_ns)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = read(source)
        return _LOADED[key]
