"""A short, stable fingerprint of a model: its architecture config and a sample of its weights.

Two loads of the same checkpoint give the same fingerprint (whatever its name or path); another model,
another size or retrained weights give another one. Hashing every weight of a large model would take
seconds, so each parameter contributes its name, shape, dtype and an evenly strided sample of at most
``SAMPLE`` of its values, rounded to bfloat16 so a float32 and a bfloat16 load of one checkpoint agree.
:func:`checkpoint_fingerprint` gives the same value from the checkpoint's files, for engines (vLLM) whose
modules fuse or rename the weights. A module of its own, outside :mod:`sparseety.models`, so that vLLM's
worker can import it without the model registry.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

SAMPLE = 1024
_CONFIG_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "max_position_embeddings",
                "tie_word_embeddings")
_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def config_summary(model: torch.nn.Module) -> dict[str, Any]:
    """The architecture fields of the model's (text) config that the fingerprint covers."""
    return _summary(model.config)


def _summary(config: Any) -> dict[str, Any]:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {key: _plain(getattr(config, key, None)) for key in _CONFIG_KEYS}


def model_fingerprint(model: torch.nn.Module) -> str:
    """``sha256:<16 hex>`` of the config summary and the sampled weights (cached per model object)."""
    if model in _CACHE:
        return _CACHE[model]
    with torch.no_grad():
        value = _digest(config_summary(model), model.named_parameters())
    _CACHE[model] = value
    return value


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """:func:`model_fingerprint` of the Hugging Face checkpoint in ``model_dir`` (``config.json`` and its
    ``*.safetensors``), read from the files: the value the same checkpoint gives once loaded with ``transformers``."""
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = Path(model_dir)
    summary = _summary(AutoConfig.from_pretrained(folder))
    handles = [safe_open(str(path), framework="pt") for path in sorted(folder.glob("*.safetensors"))]
    return _digest(summary, ((name, h.get_tensor(name)) for h in handles for name in h.keys()))  # noqa: SIM118


def _digest(summary: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256(json.dumps(summary, sort_keys=True).encode())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLE)
        sample = flat[::step][:SAMPLE].to(device="cpu", dtype=torch.bfloat16).float().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:".encode())
        digest.update(sample.numpy().tobytes())
    return "sha256:" + digest.hexdigest()[:16]


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
