"""Byte sizes as people write them: ``512MiB``, ``2GiB``, ``1.5GB``, ``1000000``."""

from __future__ import annotations

import re

from sparseety.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
MAX_BYTES = 2**50  #: 1 PiB: anything larger is a typo


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes in ``text`` (an int, or a number with an optional unit); :class:`ConfigError` names ``what``."""
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
    if not 1 <= value <= MAX_BYTES:
        raise ConfigError(f"{what} must be between 1 byte and 1 PiB, got {text!r}")
    return value
