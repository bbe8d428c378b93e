"""One exception hierarchy: every user-facing failure is a :class:`SparseetyError`."""

from __future__ import annotations

from pathlib import Path


class SparseetyError(Exception):
    """Base class of every error SparSEEty raises on purpose; the CLI prints it as ``error: ...``."""


class ConfigError(SparseetyError, ValueError):
    """A configuration value is invalid (unknown name, out-of-range number, unknown key)."""


class ShapeError(SparseetyError, ValueError):
    """A tensor has the wrong rank or shape; the message names the offending shapes."""


class AlignmentError(ShapeError):
    """A signal's token axis does not line up with the token ids."""


class RecordError(SparseetyError, ValueError):
    """An offline record is malformed: bad JSON, missing or mistyped keys, unsafe paths or files."""


class ModelLoadError(SparseetyError):
    """A model name or path cannot be resolved or loaded."""


class InputError(SparseetyError, ValueError):
    """A prompt or other request input is unusable (empty, too long for the model)."""


class QueryLimitError(InputError):
    """A SQL statement passed a limit of the sandbox (``limit``: ``"timeout"`` or ``"memory"``) and was stopped."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class OutputSavedElsewhere(SparseetyError):
    """A finished result could not be written where asked and was saved at ``fallback`` instead (the CLI
    prints the message, which names both paths, as ``error: ...`` and exits with code 1)."""

    def __init__(self, message: str, fallback: Path) -> None:
        super().__init__(message)
        self.fallback = fallback


SHOWN_CHARS = 80  #: the most characters of a value from outside that a message repeats


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said (``'aaaa...' (102400 chars)``)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = len(value) if isinstance(value, (str, bytes, list, dict, tuple)) else len(text)
    return f"{text[:limit]}... ({size} chars)"
