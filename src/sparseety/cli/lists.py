"""Comma-separated list flags (``--ratios 0.25,0.5``) parsed with clear errors. One rule for every such flag:
an empty item (``0.5,,0.5``, a trailing comma) and a value given twice (``kvzap,kvzap``; ``0.5,0.50``) are
refused, since either would run the same work twice or hide a typo."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sparseety.errors import ConfigError

T = TypeVar("T")


def parse_list(raw: str, flag: str, kind: Callable[[str], T], check: Callable[[T], bool] | None = None,
               expect: str = "") -> list[T]:
    """Split ``raw`` on commas and convert each item; ``check`` rejects values outside ``expect``; an empty item
    or a value listed twice is refused."""
    items = [x.strip() for x in raw.split(",")]
    if not any(items):
        raise ConfigError(f"{flag} needs at least one value")
    out: list[T] = []
    for number, item in enumerate(items, 1):
        if not item:
            raise ConfigError(f"{flag}: item {number} of {raw!r} is empty; separate the values with single commas")
        try:
            value = kind(item)
        except ValueError:
            raise ConfigError(f"{flag}: {item!r} is not a valid {getattr(kind, '__name__', 'value')}") from None
        if check is not None and not check(value):
            raise ConfigError(f"{flag}: {item} is out of range ({expect})")
        if value in out:
            raise ConfigError(f"{flag}: {item} is listed twice in {raw!r}; give each value once")
        out.append(value)
    return out
