"""Module probes beside the attention hook: MoE router probabilities and MLP activation statistics.

Forward hooks are registered on the wrapped model's own modules for one run and removed after; they
only read tensors, never change them. Shapes recorded per layer, concatenated over forwards:
router probabilities ``[tokens, experts]`` and activation stats ``[tokens]``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


@dataclass
class ModuleProbes:
    """Collects router probabilities (MoE models) and MLP activation stats while attached."""

    zero_eps: float = 1e-3
    router_probs: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    act_maxabs: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    act_zero_frac: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    _handles: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)

    def attach(self, model: torch.nn.Module) -> ModuleProbes:
        """Register the hooks on ``model``'s routers and MLP down-projections."""
        for name, module in model.named_modules():
            layer = _layer_of(name)
            if layer is None:
                continue
            if type(module).__name__.endswith("Router") or (name.endswith(".gate") and "moe" in type(module).__name__.lower()):
                self._handles.append(module.register_forward_hook(self._router_hook(layer)))
            elif name.endswith("mlp.down_proj"):
                self._handles.append(module.register_forward_pre_hook(self._activation_hook(layer)))
        return self

    def detach(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _router_hook(self, layer: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            probs = torch.softmax(logits.detach().float().reshape(-1, logits.shape[-1]), dim=-1)
            self.router_probs[layer].append(probs.cpu())
        return hook

    def _activation_hook(self, layer: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1]).abs()
            self.act_maxabs[layer].append(x.amax(dim=-1).float().cpu())
            self.act_zero_frac[layer].append((x < self.zero_eps).float().mean(dim=-1).cpu())
        return hook

    @staticmethod
    def _stack(per_layer: dict[int, list[torch.Tensor]]) -> dict[int, np.ndarray]:
        return {layer: torch.cat(chunks).numpy() for layer, chunks in sorted(per_layer.items())}

    def routers(self) -> dict[int, np.ndarray]:
        """Per MoE layer, ``[tokens_fed, experts]`` router probabilities."""
        return self._stack(self.router_probs)

    def activations(self) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Per layer, ``[tokens_fed]`` max ``|x|`` and fraction of ``|x| < zero_eps`` at the MLP's down-projection input."""
        return self._stack(self.act_maxabs), self._stack(self.act_zero_frac)
