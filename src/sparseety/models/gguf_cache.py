"""Convert a GGUF checkpoint once into a local safetensors directory, so later loads take seconds."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """The folder SparSEEty caches converted models in: ``$SPARSEETY_CACHE`` or the user's cache dir."""
    override = os.environ.get("SPARSEETY_CACHE")
    return Path(override) if override else Path(platformdirs.user_cache_dir("sparseety"))


def convert_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> Path:
    """De-quantize ``gguf_dir/gguf_file`` to float32 and save it as a transformers directory at ``target``.

    The directory is written under a temporary name and renamed into place, so a crash never leaves
    a half-written cache that a later load would trust.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are plain float32 now
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
