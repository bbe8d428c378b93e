"""Held-out prompts of ``bench faithfulness``: a passage of real text plus a question.

By default the passages come from the licence texts under ``/usr/share/common-licenses`` (text that
ships on the machine, never used to tune anything): one passage per file, from the file's middle,
cut at a line start to about ``tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from sparseety.errors import InputError

LICENSES = Path("/usr/share/common-licenses")
DEFAULT_FILES = ("Apache-2.0", "Artistic", "GFDL-1.3", "GPL-3", "LGPL-2.1", "MPL-2.0")
#: ends with an answer prefix (as RULER's tasks do): with a bare "Answer:" the default model ends its turn at
#: once on half of the licence passages, which leaves an end-of-turn token as the whole target
QUESTION = "\n\nQuestion: What is the passage above about?\nAnswer: The passage"


def default_texts() -> list[Path]:
    """The default passage files that exist on this machine."""
    return [LICENSES / name for name in DEFAULT_FILES if (LICENSES / name).is_file()]


def read_passage_text(path: Path, what: str = "--text") -> str:
    """The file's text, refused (naming ``what``, the argument that gave it) when it cannot be read, is not
    UTF-8 (the byte offset of the first bad byte: never replacement characters) or holds no text."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
                         f"({exc.reason}); convert the file to UTF-8 first") from None
    if not text.strip():
        raise InputError(f"{what} {path}: no text to make a passage of (the file is empty or blank)")
    return text


def make_prompts(files: Sequence[Path], encode: Callable[[str], list[int]], tokens: int = 125,
                 question: str = QUESTION, what: str = "--text") -> list[tuple[str, list[int]]]:
    """``(title, ids)`` per file: about ``tokens`` tokens of its text from its middle, then ``question``;
    ``what`` names the argument the files came from in a refusal (:func:`read_passage_text`)."""
    if tokens < 8:
        raise InputError(f"--tokens must be at least 8, got {tokens}")
    prompts = []
    for path in files:
        text = read_passage_text(path, what)
        lines = text.splitlines(keepends=True)
        start = len(lines) // 2
        passage = ""
        for line in lines[start:]:
            if len(encode(passage + line)) > tokens:
                break
            passage += line
        if len(encode(passage)) < tokens // 2:  # long lines: cut by words
            words = "".join(lines[start:]).split()
            passage = " ".join(words[: max(1, tokens * 3 // 4)])
        if not passage.strip():
            raise InputError(f"{what} {path}: no text to make a passage of")
        prompts.append((path.name, encode(passage.strip() + question)))
    return prompts
