"""Offline first: SparSEEty (its command line and ``load_model``) resolves models from the machine (built-in names, local
directories, the Hugging Face cache) and never waits on the network, unless the user opts in with
``SPARSEETY_ALLOW_DOWNLOADS=1``; a model that is not here fails at once, saying how to provide it."""

from __future__ import annotations

import os
import sys

ALLOW_DOWNLOADS = "SPARSEETY_ALLOW_DOWNLOADS"
HINT = (f"models resolve offline: give a built-in name (`sparseety models list`), a local model directory, "
        f"or set {ALLOW_DOWNLOADS}=1 to download a Hugging Face id")


def downloads_allowed() -> bool:
    """Whether the user opted in to downloads."""
    return os.environ.get(ALLOW_DOWNLOADS, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_offline() -> None:
    """Switch the Hugging Face libraries to offline mode unless downloads are allowed (or the user set
    ``HF_HUB_OFFLINE`` themselves)."""
    if downloads_allowed():
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", os.environ["HF_HUB_OFFLINE"])
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None and os.environ["HF_HUB_OFFLINE"].strip().lower() in ("1", "true", "yes", "on"):
        constants.HF_HUB_OFFLINE = True  # read at import time: a process that imported it already


def offline_hint() -> str | None:
    """What to add to a model-loading error while resolving offline (None when downloads are allowed)."""
    return None if downloads_allowed() else HINT
