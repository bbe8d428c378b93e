"""The sparse engine: hook point, ``SparseCache``, run context, probes and generation."""

from sparseety.engine.cache import SparseCache, SparseLayer
from sparseety.engine.generate import SparseEngine
from sparseety.engine.inputs import (
    EncodedInput,
    encode_document,
    encode_messages,
    encode_prompt,
)
from sparseety.engine.result import RunResult

__all__ = ["EncodedInput", "RunResult", "SparseCache", "SparseEngine", "SparseLayer", "encode_document", "encode_messages", "encode_prompt"]
