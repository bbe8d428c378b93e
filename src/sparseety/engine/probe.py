"""Module probes beside the attention hook: MoE router probabilities and MLP activation statistics.

Forward hooks are registered once on the wrapped model's own modules (:func:`attach_probe_hooks`) and
record into the :class:`ModuleProbes` of the run active on the calling thread, if that run has one, so
concurrent runs on one model never see each other's tensors. They only read tensors, never change them. Shapes recorded per layer, concatenated over forwards:
router probabilities ``[tokens, experts]`` and activation stats ``[tokens]``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


@dataclass
class ModuleProbes:
    """Router probabilities (MoE models) and MLP activation stats collected for one run."""

    zero_eps: float = 1e-3
    router_probs: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    act_maxabs: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    act_zero_frac: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))

    def record_router(self, layer: int, logits: torch.Tensor) -> None:
        """Store router probabilities from ``logits`` ``[..., experts]``."""
        probs = torch.softmax(logits.detach().float().reshape(-1, logits.shape[-1]), dim=-1)
        self.router_probs[layer].append(probs.cpu())

    def record_activation(self, layer: int, x: torch.Tensor) -> None:
        """Store per-token max ``|x|`` and near-zero fraction of the MLP input ``x`` ``[..., hidden]``."""
        x = x.detach().reshape(-1, x.shape[-1]).abs()
        self.act_maxabs[layer].append(x.amax(dim=-1).float().cpu())
        self.act_zero_frac[layer].append((x < self.zero_eps).float().mean(dim=-1).cpu())

    @staticmethod
    def _stack(per_layer: dict[int, list[torch.Tensor]]) -> dict[int, np.ndarray]:
        return {layer: torch.cat(chunks).numpy() for layer, chunks in sorted(per_layer.items())}

    def routers(self) -> dict[int, np.ndarray]:
        """Per MoE layer, ``[tokens_fed, experts]`` router probabilities."""
        return self._stack(self.router_probs)

    def activations(self) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Per layer, ``[tokens_fed]`` max ``|x|`` and fraction of ``|x| < zero_eps`` at the MLP's down-projection input."""
        return self._stack(self.act_maxabs), self._stack(self.act_zero_frac)


def attach_probe_hooks(model: torch.nn.Module, probes_of_active_run: Callable[[], ModuleProbes | None]) -> int:
    """Register, once, read-only hooks on ``model``'s routers and MLP down-projections.

    Each hook records into ``probes_of_active_run()`` when it returns a collector. Returns the
    number of hooks registered.
    """
    count = 0
    for name, module in model.named_modules():
        layer = _layer_of(name)
        if layer is None:
            continue
        if type(module).__name__.endswith("Router") or (name.endswith(".gate") and "moe" in type(module).__name__.lower()):
            module.register_forward_hook(_router_hook(layer, probes_of_active_run))
            count += 1
        elif name.endswith("mlp.down_proj"):
            module.register_forward_pre_hook(_activation_hook(layer, probes_of_active_run))
            count += 1
    return count


def _router_hook(layer: int, probes: Callable[[], ModuleProbes | None]):
    def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
        collector = probes()
        if collector is not None:
            collector.record_router(layer, output[0] if isinstance(output, tuple) else output)
    return hook


def _activation_hook(layer: int, probes: Callable[[], ModuleProbes | None]):
    def hook(module: torch.nn.Module, args: tuple) -> None:
        collector = probes()
        if collector is not None:
            collector.record_activation(layer, args[0])
    return hook
