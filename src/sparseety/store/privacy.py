"""Redaction of secrets in stored text: typed placeholders replace emails, phone numbers, IP
addresses, credit-card-like numbers (Luhn-checked) and API-key-like strings.

Redaction runs in the writer before anything reaches disk. Token texts are redacted together: a
token whose text overlaps a redacted span of the joined text gets the placeholder as its text.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

EMAIL = "[EMAIL]"
PHONE = "[PHONE]"
IP = "[IP]"
CARD = "[CARD]"
API_KEY = "[API_KEY]"
PLACEHOLDERS = (EMAIL, PHONE, IP, CARD, API_KEY)


def _luhn(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _ipv6(candidate: str) -> bool:
    try:
        return ipaddress.ip_address(candidate.strip("[]")).version == 6
    except ValueError:
        return False


def _mixed_token(candidate: str) -> bool:
    """A long run looks like a key when it mixes digits and letters (not a word, not a number)."""
    return any(c.isdigit() for c in candidate) and any(c.isalpha() for c in candidate)


_Check = Callable[[str], bool] | None

# Earlier rules win where spans overlap (an API key holding digits is not also a phone number).
_RULES: tuple[tuple[str, re.Pattern[str], _Check], ...] = (
    (API_KEY, re.compile(r"\bsk-(?:proj-|live-|test-)?[A-Za-z0-9_\-]{16,}"), None),
    (API_KEY, re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), None),
    (API_KEY, re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), None),
    (API_KEY, re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"), None),
    (API_KEY, re.compile(r"\bAIza[0-9A-Za-z_\-]{35}"), None),
    (API_KEY, re.compile(r"\b(?:[A-Fa-f0-9]{32,}|[A-Za-z0-9+/_\-]{32,}={0,2})(?![A-Za-z0-9+/_\-])"), _mixed_token),
    (EMAIL, re.compile(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}"), None),
    (CARD, re.compile(r"(?<![\d])\d(?:[ \-]?\d){12,18}(?![\d])"), _luhn),
    (IP, re.compile(r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\d.])"),
     None),
    (IP, re.compile(r"(?<![0-9A-Fa-f:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![0-9A-Fa-f:])"), _ipv6),
    # A phone number is not part of a longer digit group (a mistyped card, an account number).
    (PHONE, re.compile(r"(?<![\w+])(?<!\d[\s.\-])(?:\+\d{1,3}[\s.\-]?)?(?:\(\d{2,4}\)[\s.\-]?|\d{2,4}[\s.\-])"
                       r"\d{3,4}[\s.\-]?\d{3,4}(?!\w)(?![\s.\-]\d)"),
     None),
)


@dataclass(frozen=True, slots=True)
class Span:
    """A redacted character range ``[start, end)`` and its placeholder."""

    start: int
    end: int
    placeholder: str


def find_secrets(text: str) -> list[Span]:
    """Non-overlapping secret spans of ``text``, in order; earlier rules win overlaps."""
    taken: list[Span] = []
    for placeholder, pattern, check in _RULES:
        for match in pattern.finditer(text):
            if check is not None and not check(match.group()):
                continue
            span = Span(match.start(), match.end(), placeholder)
            if all(span.end <= t.start or span.start >= t.end for t in taken):
                taken.append(span)
    return sorted(taken, key=lambda s: s.start)


def redact_text(text: str) -> str:
    """``text`` with every secret replaced by its typed placeholder."""
    spans = find_secrets(text)
    if not spans:
        return text
    out, last = [], 0
    for span in spans:
        out.append(text[last : span.start])
        out.append(span.placeholder)
        last = span.end
    out.append(text[last:])
    return "".join(out)


def redact_tokens(texts: Sequence[str]) -> tuple[list[str], dict[int, str]]:
    """Redact per-token texts through their joined text.

    Returns
    -------
    texts : the token texts, a token overlapping a secret replaced by the placeholder.
    redacted : position -> placeholder, for every token that overlapped a secret.
    """
    joined = "".join(texts)
    spans = find_secrets(joined)
    out = list(texts)
    redacted: dict[int, str] = {}
    if not spans:
        return out, redacted
    starts, offset = [], 0
    for text in texts:
        starts.append(offset)
        offset += len(text)
    index = 0
    for position, (start, text) in enumerate(zip(starts, texts)):
        end = start + len(text)
        while index < len(spans) and spans[index].end <= start:
            index += 1
        hit = next((s for s in spans[index:] if s.start < end and s.end > start), None) if text else None
        if hit is not None:
            out[position] = hit.placeholder
            redacted[position] = hit.placeholder
    return out, redacted


def redact_value(value: Any, *, drop_text: bool = False) -> Any:
    """Redact every string inside a JSON-like value (dicts, lists); ``drop_text`` nulls text fields.

    With ``drop_text`` (ids-only storage) the values of keys that name text (``text``, ``*_text``,
    ``texts``, ``*_texts``) become None and other strings are redacted.
    """
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {
            key: None if drop_text and names_text(str(key)) else redact_value(item, drop_text=drop_text)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact_value(item, drop_text=drop_text) for item in value]
    return value


def names_text(key: str) -> bool:
    """Whether a JSON key names text (``text``, ``*_text``, ``texts``, ``*_texts``, ``prompt``, ``completion``)."""
    key = key.lower()
    return key in ("text", "texts", "prompt", "completion") or key.endswith(("_text", "_texts"))
