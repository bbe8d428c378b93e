"""How many torch threads a command runs the model on: chosen on purpose, never torch's one per core.

Torch's default splits every parallel region over all cores, so one core busy with anything else
stalls each region until its share is done (on 2 cores with the other one busy, long-context decode
fell to 0.46-0.85 of its unloaded speed). Every command that runs a model, ``serve`` included, takes
``--threads`` and otherwise leaves one core free: one fewer thread than the cores this process may
run on, at least 1.
"""

from __future__ import annotations

import os
import sys

from sparseety.errors import InputError

MAX_THREADS = 1024  #: the most ``--threads`` accepts (the same bound as :mod:`sparseety.cli.bounds`)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which ``taskset`` and cgroup cpusets narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def choose_threads(requested: int | None, cores: int | None = None, flag: str = "--threads") -> int:
    """``requested`` once checked, else one fewer than ``cores`` (default: :func:`available_cores`), at least 1.

    Raises
    ------
    InputError
        ``requested`` is not an integer from 1 to :data:`MAX_THREADS`, naming ``flag``.
    """
    if requested is None:
        return max(1, (available_cores() if cores is None else cores) - 1)
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise InputError(f"{flag} must be a whole number of threads, got {requested!r}")
    if not 1 <= requested <= MAX_THREADS:
        raise InputError(f"{flag} must be from 1 to {MAX_THREADS} threads, got {requested}")
    return requested


def describe_threads(threads: int, requested: int | None, cores: int) -> str:
    """The line a command prints: ``threads: 1 (of 2 cores, one left free; --threads sets it)``."""
    of = f"of {cores} core{'s' if cores != 1 else ''}"
    if requested is None:
        return f"threads: {threads} ({of}{', one left free' if threads < cores else ''}; --threads sets it)"
    return f"threads: {threads} ({of}{', more threads than cores' if threads > cores else ''}; set by --threads)"


def use_threads(requested: int | None, *, quiet: bool = False) -> int:
    """Set torch's intra-op threads for this process (see :func:`choose_threads`) and say so on stderr
    in one line unless ``quiet`` (``--json`` or ``--quiet``: stderr then carries only warnings and errors).
    Returns the number set."""
    import torch

    cores = available_cores()
    threads = choose_threads(requested, cores)
    torch.set_num_threads(threads)
    if not quiet:
        print(describe_threads(threads, requested, cores), file=sys.stderr, flush=True)
    return threads
