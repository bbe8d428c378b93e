"""Progress of long commands on stderr: a Rich bar with rate and ETA on a terminal, one plain line per
step otherwise (logs, pipes, CI), nothing when quiet (``--json`` or ``--quiet``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Steps(Protocol):
    """What a command reports: one call per finished step."""

    def advance(self, detail: str) -> None: ...


class _Quiet:
    def advance(self, detail: str) -> None:
        return None


class _Lines:
    """``[3/12] what: detail (2.1 s/step, about 19 s left)``, one line per step."""

    def __init__(self, total: int, done: int, what: str) -> None:
        self.total, self.done, self.what = total, done, what
        self.start, self.fresh = time.monotonic(), 0

    def advance(self, detail: str) -> None:
        self.done += 1
        self.fresh += 1
        per = (time.monotonic() - self.start) / self.fresh
        left = max(0, self.total - self.done) * per
        print(f"[{self.done}/{self.total}] {self.what}: {detail} ({per:.1f} s/step, about {left:.0f} s left)",
              file=sys.stderr, flush=True)


@contextmanager
def steps(total: int, what: str, *, quiet: bool = False, done: int = 0) -> Iterator[Steps]:
    """Report ``total`` steps of ``what`` (``done`` of them finished before, as on ``--resume``)."""
    if quiet or total <= 0:
        yield _Quiet()
        return
    if not sys.stderr.isatty():
        yield _Lines(total, done, what)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(what, total=total, completed=done, detail="", rate="")
        yield _Bar(progress, task)


class _Bar:
    """The Rich bar, with a steps-per-minute rate (Rich's own speed column is per second, often 0.00)."""

    def __init__(self, progress: object, task: int) -> None:
        self.progress, self.task = progress, task
        self.start, self.fresh = time.monotonic(), 0

    def advance(self, detail: str) -> None:
        self.fresh += 1
        rate = self.fresh / max(time.monotonic() - self.start, 1e-9) * 60
        self.progress.update(self.task, advance=1, detail=detail, rate=f"{rate:.1f}/min")  # type: ignore[attr-defined]
