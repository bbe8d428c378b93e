"""``pyramid``: PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sparseety.policies.base import check_positive_int
from sparseety.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidPolicy(SnapKVPolicy):
    """SnapKV scoring with per-layer budgets shrinking linearly with depth; their mean is ``budget``.

    The deepest layer gets ``b_min = max(window, budget // beta)``, the first ``2 * budget - b_min``.
    As in PyramidKV, nothing is compressed while the sequence still fits the mean budget.
    """

    name: ClassVar[str] = "pyramid"
    summary: ClassVar[str] = "SnapKV scoring, budgets shrinking linearly with depth (PyramidKV)"

    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(self.name, "beta", self.beta)

    def stacks_decode(self) -> bool:
        return False  # every layer has its own budget

    def layer_budget(self, layer: int, num_layers: int, seen: int | None = None) -> int | None:
        if self.budget is None or (seen is not None and seen <= self.budget):
            return None
        b_min = min(self.budget, max(self.window, self.budget // self.beta))
        b_max = 2 * self.budget - b_min
        if num_layers <= 1:
            return self.budget
        return max(1, round(b_max - (b_max - b_min) * layer / (num_layers - 1)))
