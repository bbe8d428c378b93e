"""Comma-separated list flags (``--ratios 0.25,0.5``) parsed with clear errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sparseety.errors import ConfigError

T = TypeVar("T")


def parse_list(raw: str, flag: str, kind: Callable[[str], T], check: Callable[[T], bool] | None = None,
               expect: str = "") -> list[T]:
    """Split ``raw`` on commas and convert each item; ``check`` rejects values outside ``expect``."""
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{flag} needs at least one value")
    out: list[T] = []
    for item in items:
        try:
            value = kind(item)
        except ValueError:
            raise ConfigError(f"{flag}: {item!r} is not a valid {getattr(kind, '__name__', 'value')}") from None
        if check is not None and not check(value):
            raise ConfigError(f"{flag}: {item} is out of range ({expect})")
        out.append(value)
    return out
