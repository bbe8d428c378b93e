"""Token classes: what kind of text a token is (special, punctuation, digits, words, whitespace).

Shared by the bias analysis (which classes a policy keeps) and the ``learned`` policy's features.
"""

from __future__ import annotations

import re
import unicodedata

TOKEN_CLASSES = ("special", "punctuation", "digits", "words", "whitespace")
_SPECIAL_TEXT = re.compile(r"^(<\|[^<>|]*\|>|</?s>|<(pad|unk|bos|eos|mask|cls|sep)>|\[(PAD|UNK|CLS|SEP|MASK)\])$")


def token_class(text: str, special: bool = False) -> str:
    """One of :data:`TOKEN_CLASSES` for a token's text (``special`` for special-token ids)."""
    if special or _SPECIAL_TEXT.match(text):
        return "special"
    stripped = text.strip()
    if not stripped:
        return "whitespace"
    if stripped.isdigit():
        return "digits"
    if all(unicodedata.category(c)[0] in "PS" for c in stripped):
        return "punctuation"
    return "words"
