"""SparSEEty: make the token flow of sparse LLM inference visible and measurable.

In Python (``docs/python.md``)::

    import sparseety

    model = sparseety.load("smollm2-135m")
    result = model.generate("The capital of France is", policy="snapkv", budget=64, max_new_tokens=8)

The names below load on first use, so ``import sparseety`` stays light (no torch until ``load``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparseety.version import __version__

if TYPE_CHECKING:
    from sparseety.api import Generation, Model, load
    from sparseety.options import GenerationOptions

__all__ = ["Generation", "GenerationOptions", "Model", "__version__", "load"]


def __getattr__(name: str) -> Any:
    """``load``, ``Model``, ``Generation`` (:mod:`sparseety.api`) and ``GenerationOptions``, imported when first used."""
    if name in ("load", "Model", "Generation"):
        from sparseety import api

        return getattr(api, name)
    if name == "GenerationOptions":
        from sparseety.options import GenerationOptions

        return GenerationOptions
    raise AttributeError(f"module 'sparseety' has no attribute {name!r}")
