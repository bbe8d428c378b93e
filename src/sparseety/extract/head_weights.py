"""Learned head weights of ``--importance learned``: one non-negative weight per (layer, head).

A weights file is JSON (``sparseety learn-importance`` writes it)::

    {"format": "sparseety-head-weights", "format_version": 1, "model": "smollm2-135m",
     "model_fingerprint": "sha256:...", "feature": "output", "weights": [[w_00, w_01, ...], ...],
     "provenance": {...}}

``weights`` is ``[layers][heads]`` (query heads); ``feature`` is the per-head score they weigh
(``attention``, ``value`` or ``output``, :mod:`sparseety.extract.scoring`). The file is refused for a
model of another fingerprint (:mod:`sparseety.fingerprint`), with both named. The package ships
one for the default model (``extract/weights/*.json``; ``python -m sparseety.training.shipped_head_weights``
regenerates it).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparseety.errors import ConfigError
from sparseety.extract.scoring import FEATURES

FORMAT = "sparseety-head-weights"
FORMAT_VERSION = 1
WEIGHTS_DIR = Path(__file__).parent / "weights"


@dataclass
class HeadWeights:
    """``weights`` ``[layers, heads]`` float32, >= 0, fitted for the model of ``model_fingerprint``."""

    weights: torch.Tensor
    feature: str
    model: str
    model_fingerprint: str
    provenance: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"  #: the file it was read from (for messages)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "model": self.model,
                "model_fingerprint": self.model_fingerprint, "feature": self.feature,
                "weights": [[round(float(w), 6) for w in row] for row in self.weights], "provenance": self.provenance}

    def identity(self) -> dict[str, str]:
        """Where the weights came from and a digest of them (what a result records to name them)."""
        digest = hashlib.sha256(json.dumps([self.feature, self.model_fingerprint, self.to_json()["weights"]]).encode())
        return {"source": self.source, "feature": self.feature, "digest": "sha256:" + digest.hexdigest()[:16]}

    def save(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return target

    def check_for(self, model_name: str, fingerprint: str, num_layers: int, num_heads: int) -> None:
        """Refuse weights fitted for another model (both fingerprints named) or of another shape."""
        if fingerprint != self.model_fingerprint:
            raise ConfigError(
                f"importance weights {self.source} were fitted for model {self.model!r} (fingerprint "
                f"{self.model_fingerprint}), but this run uses model {model_name!r} (fingerprint {fingerprint}); "
                "fit weights for it with `sparseety learn-importance`")
        if tuple(self.weights.shape) != (num_layers, num_heads):
            raise ConfigError(f"importance weights {self.source} are {list(self.weights.shape)} (layers, heads); "
                              f"model {model_name!r} has {num_layers} layers of {num_heads} heads")


def read_head_weights(path: str | Path) -> HeadWeights:
    """Read and check a weights file.

    Raises
    ------
    ConfigError
        An unreadable or damaged file: not JSON, another format or version, a missing field, an unknown
        ``feature``, ragged, negative or non-finite weights; or all-zero weights (every token would score 0.0
        and rank in position order). Equal non-zero weights are accepted: they are the head-mean baseline.
    """
    source = Path(path)
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read importance weights {source}: {type(exc).__name__}: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        got = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ConfigError(f"importance weights {source}: not a head-weights file (format {got!r}, expected {FORMAT!r})")
    if document.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"importance weights {source}: format version {document.get('format_version')!r}; this "
                          f"version reads {FORMAT_VERSION}")
    for key in ("model", "model_fingerprint", "feature", "weights"):
        if key not in document:
            raise ConfigError(f"importance weights {source}: damaged (no {key!r})")
    if document["feature"] not in FEATURES:
        raise ConfigError(f"importance weights {source}: feature must be one of {', '.join(FEATURES)}, "
                          f"got {document['feature']!r}")
    rows = document["weights"]
    if (not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows)
            or len({len(r) for r in rows}) != 1
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for r in rows for w in r)):
        raise ConfigError(f"importance weights {source}: damaged weights (expected a [layers][heads] list of numbers)")
    bad = [w for r in rows for w in r if not math.isfinite(w) or w < 0]
    if bad:
        raise ConfigError(f"importance weights {source}: weights must be finite and >= 0, got {bad[0]!r}")
    values = {w for r in rows for w in r}
    if values == {0} or values == {0.0}:
        raise ConfigError(f"importance weights {source}: every weight is 0, so --importance learned would score "
                          "every token 0.0 and rank them in position order; fit the file again with "
                          "`sparseety learn-importance`")
    provenance = document.get("provenance")
    return HeadWeights(torch.tensor(rows, dtype=torch.float32), str(document["feature"]), str(document["model"]),
                       str(document["model_fingerprint"]), provenance if isinstance(provenance, dict) else {},
                       source=str(source))


def shipped_head_weights(fingerprint: str) -> HeadWeights | None:
    """The weights shipped in :data:`WEIGHTS_DIR` fitted for the model of ``fingerprint``, or None."""
    if not WEIGHTS_DIR.is_dir():
        return None
    for path in sorted(WEIGHTS_DIR.glob("*.json")):
        weights = read_head_weights(path)
        if weights.model_fingerprint == fingerprint:
            return weights
    return None


def resolve_head_weights(weights: HeadWeights | str | Path | None, model_name: str, fingerprint: str,
                         num_layers: int, num_heads: int) -> HeadWeights:
    """``weights`` (read if a path) checked for the model, or the shipped ones for it (ConfigError if none)."""
    if weights is None:
        found = shipped_head_weights(fingerprint)
        if found is None:
            raise ConfigError(f"importance 'learned': no shipped weights for model {model_name!r} (fingerprint "
                              f"{fingerprint}); give --importance-weights FILE (fit one with `sparseety "
                              "learn-importance`)")
        weights = found
    elif not isinstance(weights, HeadWeights):
        weights = read_head_weights(weights)
    weights.check_for(model_name, fingerprint, num_layers, num_heads)
    return weights
