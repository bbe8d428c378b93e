"""Layer selection for online extraction: which layers record importance (``all``, ``auto`` or a list).

``auto`` picks, per request, the layer whose attention is most concentrated: the highest top-k mass
of the last prompt row (mean over query heads), measured in prefill; only that layer then records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparseety.errors import ConfigError

ALL = "all"
AUTO = "auto"


@dataclass(frozen=True)
class LayerSelection:
    """``mode`` is ``all``, ``auto`` or ``list``; ``layers`` holds the listed layers (ascending)."""

    mode: str = ALL
    layers: tuple[int, ...] = ()

    def fixed(self, num_layers: int) -> tuple[int, ...] | None:
        """The layers recorded, known before the run (None for ``auto``)."""
        if self.mode == ALL:
            return tuple(range(num_layers))
        return self.layers if self.mode == "list" else None

    def text(self) -> str:
        """The selection in ``--layers`` form."""
        return ",".join(map(str, self.layers)) if self.mode == "list" else self.mode


def parse_layers(spec: str | Sequence[int] | LayerSelection | None, num_layers: int | None = None) -> LayerSelection:
    """Parse ``"all"``, ``"auto"``, ``"0,15,29"`` or a sequence of ints; validate against ``num_layers`` when given.

    Raises :class:`ConfigError` for malformed lists, duplicates and layers outside the model.
    """
    if isinstance(spec, LayerSelection):
        selection = spec
    elif spec is None or (isinstance(spec, str) and spec.strip().lower() == ALL):
        selection = LayerSelection()
    elif isinstance(spec, str) and spec.strip().lower() == AUTO:
        selection = LayerSelection(AUTO)
    else:
        parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
        layers: list[int] = []
        for part in parts:
            try:
                if isinstance(part, bool) or isinstance(part, float):
                    raise ValueError
                layer = int(part)
            except (TypeError, ValueError):
                raise ConfigError(f"--layers: {part!r} is not a layer number; expected all, auto or a list "
                                  "such as 0,15,29") from None
            if layer < 0:
                raise ConfigError(f"--layers: layer {layer} is negative")
            if layer in layers:
                raise ConfigError(f"--layers: layer {layer} is listed twice")
            layers.append(layer)
        if not layers:
            raise ConfigError("--layers: no layer given; expected all, auto or a list such as 0,15,29")
        selection = LayerSelection("list", tuple(sorted(layers)))
    if num_layers is not None:
        for layer in selection.layers:
            if layer >= num_layers:
                raise ConfigError(f"--layers: layer {layer} is outside the model's layers 0..{num_layers - 1}")
    return selection


def topk_mass(last_row: torch.Tensor, k: int) -> float:
    """Attention mass of the ``k`` most attended keys of one row.

    Parameters
    ----------
    last_row : ``[b, heads, n]`` probabilities of the last prompt row (batch 0 is used).
    k : keys counted (clipped to ``n``).

    Returns
    -------
    The sum of the ``k`` largest entries of the row averaged over query heads (in ``[0, 1]``).
    """
    row = last_row[0].float().mean(dim=0)
    return float(row.topk(min(k, row.shape[-1])).values.sum())
