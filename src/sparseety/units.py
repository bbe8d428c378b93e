"""Byte sizes as people write them: ``512MiB``, ``2GiB``, ``1.5GB``, ``1000000``."""

from __future__ import annotations

import re

from sparseety.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
MAX_BYTES = 2**50  #: 1 PiB: anything larger is a typo


def _size_words(n: int) -> str:
    """``1 byte``, ``1 MiB``, ``1 PiB``: a limit as the messages state it."""
    for unit, scale in (("PiB", 2**50), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return "1 byte" if n == 1 else f"{n} bytes"


def parse_size(text: str | int, what: str = "size", minimum: int = 1) -> int:
    """Bytes in ``text`` (an int, or a number with an optional unit), at least ``minimum``; :class:`ConfigError`
    names ``what`` and the range the check applies."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} must be a size such as 512MiB, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(f"{what} must be a size such as 512MiB, 2GiB or a number of bytes, got {text!r}")
        value = int(float(match.group(1)) * _UNITS[unit])
    if not minimum <= value <= MAX_BYTES:
        raise ConfigError(f"{what} must be between {_size_words(minimum)} and {_size_words(MAX_BYTES)}, got {text!r}")
    return value
