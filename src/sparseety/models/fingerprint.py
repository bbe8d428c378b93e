"""A short, stable fingerprint of a model: its architecture config and a sample of its weights.

Two loads of the same checkpoint give the same fingerprint (whatever its name or path); another model,
another size or retrained weights give another one. Hashing every weight of a large model would take
seconds, so each parameter contributes its name, shape, dtype and an evenly strided sample of at most
``SAMPLE`` of its values, rounded to bfloat16 so a float32 and a bfloat16 load of one checkpoint agree.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import torch

SAMPLE = 1024
_CONFIG_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "max_position_embeddings",
                "tie_word_embeddings")
_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def config_summary(model: torch.nn.Module) -> dict[str, Any]:
    """The architecture fields of the model's (text) config that the fingerprint covers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {key: _plain(getattr(config, key, None)) for key in _CONFIG_KEYS}


def model_fingerprint(model: torch.nn.Module) -> str:
    """``sha256:<16 hex>`` of the config summary and the sampled weights (cached per model object)."""
    if model in _CACHE:
        return _CACHE[model]
    digest = hashlib.sha256(json.dumps(config_summary(model), sort_keys=True).encode())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // SAMPLE)
            sample = flat[::step][:SAMPLE].to(device="cpu", dtype=torch.bfloat16).float().contiguous()
            digest.update(f"{name}:{tuple(param.shape)}:".encode())
            digest.update(sample.numpy().tobytes())
    value = "sha256:" + digest.hexdigest()[:16]
    _CACHE[model] = value
    return value


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
