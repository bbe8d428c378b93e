"""Convert a GGUF checkpoint once into a local safetensors directory, so later loads take seconds.

The directory is a plain Hugging Face checkpoint, the one ``save_pretrained`` writes: ``config.json``
names the class (``architectures``) and a tied embedding is stored under the embedding's own name
(``model.embed_tokens.weight``), with no ``lm_head.weight``. Any loader can read it: transformers ties the
head to the embedding, and vLLM, which skips a checkpoint's ``lm_head.weight`` when the weights are tied,
finds the embedding it needs.

Caches written by SparSEEty 0.1 before this layout (``safetensors.torch.save_model``) have no
``architectures`` and keep the tied tensor as ``lm_head.weight`` only; vLLM then resolves the directory as
a bare ``LlamaModel`` or, told the class, runs with an embedding that was never loaded (token 0 repeated).
:func:`migrate_cache` rewrites such a directory in place; :func:`resolve_model_dir` calls it on load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import platformdirs

WEIGHTS = "model.safetensors"
EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are plain float32 now
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        _save_weights(model, tmp / WEIGHTS)
        tokenizer.save_pretrained(tmp)
        if needs_migration(tmp):  # never trust a layout the loaders disagree on
            raise RuntimeError(f"converted checkpoint at {tmp} is not in the expected layout")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _save_weights(model: Any, path: Path) -> None:
    """The layout ``save_pretrained`` writes (it refuses a GGUF-loaded model, whose quantizer stays
    attached): every tensor once, a tied head dropped in favour of the tensor it is tied to."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        tied = getattr(model, "_tied_weights_keys", None) or {}
        for target in list(tied):  # {"lm_head.weight": "model.embed_tokens.weight"}
            state.pop(target, None)
    save_file({key: value.contiguous() for key, value in state.items()}, str(path), metadata={"format": "pt"})


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _weight_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS), framework="np") as handle:  # reads the header only
        return set(handle.keys())


def _tied_head_only(folder: Path, config: dict[str, Any]) -> bool:
    if not config.get("tie_word_embeddings", False):
        return False
    keys = _weight_keys(folder)
    return EMBED_KEY not in keys and HEAD_KEY in keys


def needs_migration(folder: Path) -> bool:
    """True for a cache in the pre-0.1 layout: no ``architectures``, or a tied embedding saved as the head only."""
    config = _config(folder)
    return not config.get("architectures") or _tied_head_only(folder, config)


def _causal_lm_class(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise RuntimeError(f"no causal-LM class is known for model_type {model_type!r}")
    return name


def _replace_atomically(path: Path, write: Any) -> None:
    """Write ``path`` through a temporary file in the same folder, then rename it over the old one."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def migrate_cache(folder: Path) -> bool:
    """Bring a cache written by an older SparSEEty to the current layout in place; False when it already was.

    Each step (weights, then config) replaces one file atomically and is detected on its own, so an
    interrupted migration finishes on the next load. Tensor values are copied bit for bit.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    config = _config(folder)
    changed = False
    if _tied_head_only(folder, config):
        with safe_open(str(folder / WEIGHTS), framework="np") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        tensors[EMBED_KEY] = tensors.pop(HEAD_KEY)
        metadata.setdefault("format", "pt")
        _replace_atomically(folder / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        changed = True
    if not config.get("architectures"):
        config["architectures"] = [_causal_lm_class(config["model_type"])]
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        _replace_atomically(folder / "config.json", lambda tmp: Path(tmp).write_text(text))
        changed = True
    return changed
