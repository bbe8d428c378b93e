"""What every benchmark records the same way: the machine block, the commit measured, the command line, and the
forward clock (time stamps of every forward of a model on the wall and CPU clocks).

Standard library only at import time (torch and transformers are read from the process if it loaded them), so
a script whose worker runs in a side venv can import it too.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  #: the repository root, where every benchmark is run from


def _version(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None and hasattr(module, "__version__"):
        return module.__version__
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine(**extra: Any) -> dict[str, Any]:
    """The machine block every benchmark saves, one set of keys: ``cpus``, ``torch_threads`` (this process's
    intra-op threads now; ``None`` where torch is not loaded), ``python``, ``platform``, ``torch``,
    ``transformers``, ``load_average`` (1, 5, 15 minutes, now), then ``extra`` (such as
    ``load_average_at_start``)."""
    torch = sys.modules.get("torch")
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads() if torch is not None else None,
            "python": platform.python_version(), "platform": platform.platform(),
            "torch": _version("torch"), "transformers": _version("transformers"),
            "load_average": [round(x, 2) for x in os.getloadavg()], **extra}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def source() -> dict[str, Any]:
    """The commit measured, and the files under ``src/`` that differ from it (work in progress measured too)."""
    return {"commit": _git("rev-parse", "HEAD") or None,
            "src_changes_not_committed": _git("status", "--porcelain", "--", "src").splitlines()}


def command(argv: Sequence[str] | None = None) -> str:
    """The command line that ran this benchmark, as typed at the repository root:
    ``.venv/bin/python -m benchmarks.NAME ARGS`` (``argv``: the arguments, default this process's)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    target = ["-m", spec.name] if spec is not None else [Path(sys.argv[0]).as_posix()]
    return shlex.join([".venv/bin/python", *target, *(sys.argv[1:] if argv is None else argv)])


#: the two clocks of :class:`ForwardClock`
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


class ForwardClock:
    """Time stamps of every forward of one model (pre-hook first in line, post-hook), on two clocks.

    ``wall`` is ``time.perf_counter``; ``cpu`` is ``time.process_time`` (CPU seconds of this process,
    all threads). With one torch thread the CPU clock counts only the cycles this process really ran,
    so it is far less disturbed by other processes on a shared machine than the wall clock.
    """

    def __init__(self, model: Any) -> None:
        self.starts: dict[str, list[float]] = {name: [] for name in CLOCKS}
        self.ends: dict[str, list[float]] = {name: [] for name in CLOCKS}
        self.on_start: Callable[[int], None] | None = None  #: called with the forward's index before it runs
        model.register_forward_pre_hook(self._pre, prepend=True)
        model.register_forward_hook(self._post)

    def reset(self) -> None:
        for name in CLOCKS:
            self.starts[name].clear()
            self.ends[name].clear()

    def _pre(self, *_: Any) -> None:
        if self.on_start is not None:
            self.on_start(len(self.starts["wall"]))
        for name, clock in CLOCKS.items():
            self.starts[name].append(clock())

    def _post(self, *_: Any) -> None:
        for name, clock in CLOCKS.items():
            self.ends[name].append(clock())

    def prefill_s(self, clock: str) -> float:
        return self.ends[clock][0] - self.starts[clock][0]

    def steps_s(self, clock: str) -> list[float]:
        """Per decode step: start-to-start of consecutive forwards; the last step is its forward alone."""
        s, e = self.starts[clock], self.ends[clock]
        if len(s) < 2:
            return []
        return [s[i + 1] - s[i] for i in range(1, len(s) - 1)] + [e[-1] - s[-1]]
