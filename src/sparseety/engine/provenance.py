"""Provenance carried by every trace (DESIGN principle 5)."""

from __future__ import annotations

import platform
from typing import Any

import torch
import transformers

from sparseety.version import __version__
from sparseety.policies.base import Policy
from sparseety.schema import SCHEMA_VERSION


def provenance(model: torch.nn.Module, model_name: str, policy: Policy, tier: int, top_k: int,
               sample_rate: float = 1.0, *, layers: str = "all", recorded_layers: list[int] | None = None,
               prune: dict[str, Any] | None = None) -> dict[str, Any]:
    """Schema version, model id and revision, library versions, policy, token pruning, extraction config
    (with the layer selection and the layers that recorded), tier, sampling."""
    config = model.config
    return {
        "schema_version": SCHEMA_VERSION,
        "sparseety_version": __version__,
        "model": model_name,
        "model_source": getattr(config, "_name_or_path", None),
        "model_revision": getattr(config, "_commit_hash", None),
        "model_type": getattr(config, "model_type", None),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "policy": policy.name,
        "policy_params": policy.params(),
        "budget": policy.budget,
        "prune": prune,
        "extraction": {"score_type": "attention", "signal": "attention received while generating",
                       "top_k": top_k, "normalize": "max", "min_score": 0.0,
                       "exclude_special": True, "layers": layers, "recorded_layers": recorded_layers},
        "tier": tier,
        "sample_rate": sample_rate,
    }
