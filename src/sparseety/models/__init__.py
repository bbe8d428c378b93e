"""Model loading: built-in names, local directories and Hugging Face ids."""

from sparseety.models.registry import (
    DEFAULT_MODEL,
    GEMMA_MODEL,
    MOE_MODEL,
    BuiltinModel,
    list_models,
    load_model,
    load_tokenizer,
)

__all__ = ["DEFAULT_MODEL", "GEMMA_MODEL", "MOE_MODEL", "BuiltinModel", "list_models", "load_model", "load_tokenizer"]
