"""Warnings of the store's readers (a skipped damaged file): one line on stderr, or collected.

Readers call :func:`notice`; by default it prints ``warning: ...`` on stderr. Inside
:func:`collected` (per thread or task, through a context variable) the lines are gathered instead, so a
server can put them in a response header (:func:`collecting`, :func:`warning_headers`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")
_SINK: ContextVar[tuple[list[str], bool] | None] = ContextVar("sparseety_store_notices", default=None)


def notice(message: str) -> None:
    """Report ``message`` once per collector (or print it as one ``warning:`` line on stderr)."""
    sink = _SINK.get()
    if sink is None:
        print(f"warning: {message}", file=sys.stderr)
        return
    notes, echo = sink
    if message not in notes:
        notes.append(message)
        if echo:
            print(f"warning: {message}", file=sys.stderr)


@contextmanager
def collected(*, echo: bool = False) -> Iterator[list[str]]:
    """Gather the notices raised inside the block into the yielded list, each once; ``echo`` also
    prints each as it first comes (a command line: one line per notice however often it is raised)."""
    notes: list[str] = []
    token = _SINK.set((notes, echo))
    try:
        yield notes
    finally:
        _SINK.reset(token)



def collecting(read: Callable[[], T]) -> tuple[T, list[str]]:
    """``read()`` and the notices it raised (for a worker thread answering one request)."""
    with collected() as notes:
        return read(), notes


def warning_headers(notes: list[str]) -> dict[str, str]:
    """``X-Sparseety-Warning`` (the notices in one ASCII line) and ``X-Sparseety-Skipped-Files``; none without notices."""
    if not notes:
        return {}
    text = " | ".join(" ".join(note.split()) for note in notes)
    return {"X-Sparseety-Warning": text.encode("ascii", "backslashreplace").decode("ascii"),
            "X-Sparseety-Skipped-Files": str(len(notes))}
