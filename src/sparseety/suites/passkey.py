"""Needle-in-a-haystack cases from real text: a pass key hidden at a chosen depth of license prose.

The haystack is made of whole sentences of the license texts that ship with Debian under
``/usr/share/common-licenses/``; a sentence ``"The pass key is NNNNN. Remember it."`` goes in at the
sentence boundary closest to ``depth`` (0 = start, 1 = end) measured in tokens. Everything is
deterministic for a seed, a length and a depth.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from sparseety.errors import ConfigError, InputError

LICENSE_DIR = Path("/usr/share/common-licenses")
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "Answer: The pass key is"  #: fed after the question for base models (no chat template)
NEEDLE = "The pass key is {passkey}. Remember it."


def word_count(text: str) -> int:
    """Whitespace-separated words: the token counter used when no tokenizer is given."""
    return len(text.split())


@functools.lru_cache(maxsize=4)
def corpus_sentences(folder: str = str(LICENSE_DIR)) -> tuple[str, ...]:
    """The sentences of every regular license file in ``folder`` (sorted by name, whitespace collapsed)."""
    root = Path(folder)
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink()) if root.is_dir() else []
    text = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    sentences = tuple(s for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text)) if len(s.split()) >= 3)
    if len(sentences) < 50:
        raise InputError(f"not enough license text under {folder} to build passkey cases")
    return sentences


@dataclass(frozen=True)
class PasskeyCase:
    """One haystack. ``context_tokens`` counts the context with the counter it was built with;
    ``needle_token`` is where the needle sentence starts, in those units."""

    length: int
    depth: float
    passkey: str
    needle: str
    context: str
    context_tokens: int
    needle_token: int

    def to_dict(self, with_context: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"length": self.length, "depth": self.depth, "needle": self.needle,
                               "passkey": self.passkey, "context_tokens": self.context_tokens,
                               "needle_token": self.needle_token}
        if with_context:
            out["context"] = self.context
        return out


def case_rng(seed: int, length: int, depth: float) -> random.Random:
    """The random stream of one case: depends only on the seed, the length and the depth."""
    return random.Random(f"passkey:{seed}:{length}:{depth!r}")


def take_sentences(start: int, length: int, count_tokens: Callable[[str], int] = word_count,
                   used: int = 0) -> tuple[list[str], list[int]]:
    """Consecutive license sentences from index ``start`` (wrapping around) and their token counts (each
    counted with its leading space), as many as bring ``used + sum(counts)`` closest to ``length``."""
    sentences = corpus_sentences()
    chosen: list[str] = []
    sizes: list[int] = []
    total = used
    i = start
    while total < length:
        sentence = sentences[i % len(sentences)]
        size = count_tokens(" " + sentence)
        if chosen and total + size - length > length - total:
            break  # stopping short is closer to the target than this sentence's overshoot
        chosen.append(sentence)
        sizes.append(size)
        total += size
        i += 1
        if len(chosen) > 10 * length:
            raise InputError(f"cannot reach {length} tokens from the license text")
    return chosen, sizes


def make_case(length: int, depth: float, seed: int = 0,
              count_tokens: Callable[[str], int] = word_count) -> PasskeyCase:
    """Build one case of about ``length`` tokens with the needle at ``depth``.

    Parameters
    ----------
    length : target context length in ``count_tokens`` units (whole sentences, as close to it
        as they allow).
    depth : where the needle goes, in [0, 1], as a fraction of the context's tokens.
    seed : the case is a pure function of ``(seed, length, depth)``.
    count_tokens : tokens in a text; pass the model tokenizer's counter for token-exact lengths.
    """
    if length < 50:
        raise ConfigError(f"passkey length must be at least 50 tokens, got {length}")
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"passkey depth must be in [0, 1], got {depth}")
    rng = case_rng(seed, length, depth)
    passkey = str(rng.randint(10_000, 9_999_999))  # 5 to 7 digits
    needle = NEEDLE.format(passkey=passkey)
    sentences = corpus_sentences()
    chosen, sizes = take_sentences(rng.randrange(len(sentences)), length, count_tokens, count_tokens(needle))
    before = [0, *accumulate(sizes)]  # tokens before each sentence boundary
    haystack = before[-1]
    cut = min(range(len(before)), key=lambda k: (abs(before[k] - depth * haystack), k))
    context = " ".join([*chosen[:cut], needle, *chosen[cut:]])
    needle_token = count_tokens(" ".join(chosen[:cut])) if cut else 0
    return PasskeyCase(length=length, depth=depth, passkey=passkey, needle=needle, context=context,
                       context_tokens=count_tokens(context), needle_token=needle_token)


def make_cases(lengths: list[int], depths: list[float], seed: int = 0,
               count_tokens: Callable[[str], int] = word_count) -> list[PasskeyCase]:
    """Every (length, depth) case, lengths outer."""
    return [make_case(n, d, seed, count_tokens) for n in lengths for d in depths]


def tokenizer_counter(tokenizer: Any) -> Callable[[str], int]:
    """A ``count_tokens`` function from a transformers tokenizer (no special tokens)."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def is_correct(passkey: str, answer: str) -> bool:
    """The digits of the pass key appear in the answer (commas and spaces between digits ignored)."""
    return passkey in re.sub(r"(?<=\d)[,\s](?=\d)", "", answer)
