"""Storing a finished run's trace (with its ``--jsonl`` rows and report) without ever losing the answer.

The trace directory is checked before the model loads (:func:`sparseety.store.dataset.check_trace_dir`); a write
that still fails afterwards is reported as a ``warning:`` line and the answer is printed anyway, with exit code 1.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sparseety.errors import InputError, SparseetyError

if TYPE_CHECKING:
    from sparseety.engine.result import RunResult

TRACE_WRITE_FAILED = 1
"""Exit code when every input was fine but a trace, its rows or its report could not be written."""


@dataclass
class Stored:
    """What :func:`store_run` wrote: the report's path, why the trace was not written (None: it was), and
    each ``warning:`` it printed."""

    report_path: Path | None = None
    trace_error: str | None = None
    warnings: list[str] = field(default_factory=list)


def reason(exc: BaseException) -> str:
    """One line saying why a write failed (the exception's type too when it is not an expected one)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (OSError, SparseetyError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def store_run(result: RunResult, trace_dir: Path, *, redact: bool, ids_only: bool, sample_rate: float,
              jsonl: Path | None, report: bool) -> Stored:
    """Write ``result``'s trace at its tier (nothing at tier 0), then its ``--jsonl`` rows and report.

    Never raises for a failed write: ``result.trace_path`` stays None, the reason is in the returned
    :class:`Stored` and a ``warning:`` line goes to stderr.
    """
    from sparseety.store import load_trace, write_trace

    stored = Stored()
    if result.tier < 1:
        return stored
    try:
        result.trace_path = str(write_trace(result, trace_dir, redact=redact, ids_only=ids_only,
                                            sample_rate=sample_rate))
    except Exception as exc:  # the answer is printed whatever went wrong here
        result.trace_path = None
        stored.trace_error = reason(exc)
        stored.warnings.append(f"trace of {result.request_id} not written: {stored.trace_error}")
    if stored.trace_error is None and jsonl is not None:
        try:
            append_jsonl(trace_dir, result.request_id, jsonl)
        except Exception as exc:
            stored.warnings.append(f"rows of {result.request_id} not appended: {reason(exc)}")
    if stored.trace_error is None and report:
        from sparseety.report import write_report

        try:
            stored.report_path = write_report(load_trace(trace_dir, result.request_id))
        except Exception as exc:
            stored.warnings.append(f"report of {result.request_id} not written: {reason(exc)}")
    for warning in stored.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return stored


def append_jsonl(trace_dir: Path, request_id: str, path: Path) -> None:
    """Append every stored row of one request to ``path`` (the config file's ``logging.output_file``);
    a missing folder is created, as ``report -o`` and ``export -o`` do."""
    from sparseety.store.export import export_jsonl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as out:
            export_jsonl(trace_dir, out, request_id=request_id)
    except OSError as exc:
        raise InputError(f"cannot write --jsonl {path}: {exc}") from None
