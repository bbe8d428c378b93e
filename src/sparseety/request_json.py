"""What a request is made of, checked the same way wherever it comes from (a ``--batch-file`` line, a server body).

:func:`parse_json_object` parses one JSON object and refuses what ``json.loads`` lets through silently:
a key given twice (the last would win), at any depth. :data:`CHAT_ROLES` are the roles a chat message may have.
"""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

from sparseety.errors import InputError

Role = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(Role)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json_object(text: str, *, what: str) -> dict[str, Any]:
    """``text`` as one JSON object; :class:`InputError` naming ``what`` when it is not JSON (with the
    column), not an object, or gives a key twice at any depth (naming the key)."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise InputError(f"{what} gives the key {exc.key!r} twice") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} is not JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise InputError(f"{what} is not JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} must be one JSON object, got {_json_type(data)}")
    return data


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}.get(
        type(value), type(value).__name__)


MAX_BYTES_PER_TOKEN = 128
"""Bytes of text one token is taken to stand for at most, to refuse a long input before tokenizing it.
Generous: the default model's longest token is 81 bytes (a run of spaces), English text averages about 4."""


def check_text_size(size: int, what: str, max_positions: int | None) -> None:
    """Refuse ``size`` bytes of text that cannot fit in a context of ``max_positions`` tokens, before it is
    tokenized (:data:`MAX_BYTES_PER_TOKEN` bytes a token at most); no check when the context is unknown."""
    if max_positions and size > MAX_BYTES_PER_TOKEN * max_positions:
        raise InputError(f"{what} is {size} bytes, more than the {MAX_BYTES_PER_TOKEN * max_positions} bytes the "
                         f"model's context of {max_positions} tokens can hold ({MAX_BYTES_PER_TOKEN} bytes a token "
                         "at most); refused before tokenizing")
