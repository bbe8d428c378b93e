"""Numbers and strings from outside (``SPARSEETY_*`` variables, per-request ``vllm_xargs``), read strictly.

A number is an ``int``/``float`` that is not a ``bool`` (``true`` is no budget), finite and in range, or a text
of ASCII decimal digits: ``'٦٤'`` and ``'6_4'`` are not 64, as Python's ``int()`` would read them. Every
message shows the value through :func:`shown`, cut to :data:`SHOWN_CHARS` characters, so a 100 KB value is
never logged or stored whole. No vLLM, no torch.
"""

from __future__ import annotations

import math
import re
from typing import Any

from sparseety.errors import SHOWN_CHARS, ConfigError, shown

__all__ = ["SHOWN_CHARS", "BadValue", "clipped", "decimal_int", "decimal_number", "is_blank", "shown"]

_INT = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` itself, cut to ``limit`` characters (for a name kept in a record or a metric label)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


class BadValue(ConfigError):
    """A value from outside that cannot be used; ``name`` is the variable or request arg it came in."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _unparsable(name: str, raw: Any, allowed: str) -> BadValue:
    return BadValue(name, f"{name}={shown(raw)} is not {allowed}")


def decimal_int(raw: Any, name: str, low: int = 1, high: int = 10**9) -> int:
    """``raw`` (an int, an integral float, or ASCII decimal digits) as an int in ``[low, high]``; else a
    :class:`BadValue` naming ``name``, the value and the range."""
    allowed = f"an integer in [{low}, {high}]"
    if isinstance(raw, bool):
        raise _unparsable(name, raw, allowed)
    if isinstance(raw, str):
        text = raw.strip()
        if not _INT.fullmatch(text) or len(text) > 19:
            raise _unparsable(name, raw, allowed)
        value = int(text)
    elif isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and math.isfinite(raw) and raw.is_integer() and abs(raw) <= 2**62:
        value = int(raw)
    else:
        raise _unparsable(name, raw, allowed)
    if not low <= value <= high:
        raise _unparsable(name, raw, allowed)
    return value


def decimal_number(raw: Any, name: str, low: float, high: float, *, high_open: bool = False) -> float:
    """``raw`` (an int, a float, or an ASCII decimal number) as a finite float in ``[low, high]`` (``[low, high)``
    with ``high_open``); else a :class:`BadValue` naming ``name``, the value and the range."""
    allowed = f"a number in [{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(raw, bool):
        raise _unparsable(name, raw, allowed)
    if isinstance(raw, str):
        text = raw.strip()
        if not _NUMBER.fullmatch(text) or len(text) > 40:
            raise _unparsable(name, raw, allowed)
        value = float(text)
    elif isinstance(raw, (int, float)):
        value = float(raw) if abs(raw) < 1e308 else math.inf
    else:
        raise _unparsable(name, raw, allowed)
    if not (math.isfinite(value) and low <= value and (value < high if high_open else value <= high)):
        raise _unparsable(name, raw, allowed)
    return value


def is_blank(raw: Any) -> bool:
    """Unset: None, or a text of only whitespace."""
    return raw is None or (isinstance(raw, str) and not raw.strip())
