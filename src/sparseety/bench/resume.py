"""Output that keeps what a long run did: the result document is rewritten (atomically) after every
finished case with ``"complete": false``, so a killed run leaves every finished case on disk, and
``--resume`` reads it back to continue without redoing them.

The document records the run's settings under ``"run"``; resuming with other settings is refused,
and so is starting over on top of an unfinished run without ``--resume``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparseety.errors import InputError


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` atomically (a reader or a kill never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(document, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {exc}") from None


def previous_run(path: Path, kind: str, run: dict[str, Any], *, resume: bool) -> dict[str, Any] | None:
    """The unfinished document to continue (``resume``), or None to start afresh.

    Raises
    ------
    InputError
        ``resume`` with a document of another kind or other settings, an unreadable document, or
        an unfinished run at ``path`` without ``resume``.
    """
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        if not resume:
            return None
        raise InputError(f"cannot resume from {path}: {exc}") from None
    if not isinstance(document, dict) or document.get("kind") != kind:
        if resume:
            raise InputError(f"cannot resume from {path}: it is not a {kind} result")
        return None
    unfinished = document.get("complete") is False
    if not resume:
        if unfinished:
            raise InputError(f"{path} holds an unfinished {kind} run ({_count(document)} finished); "
                             "pass --resume to continue it, or delete the file to start over")
        return None
    if document.get("run") != run:
        theirs = document.get("run") if isinstance(document.get("run"), dict) else {}
        changed = sorted(k for k in set(run) | set(theirs) if run.get(k) != theirs.get(k))
        raise InputError(f"cannot resume from {path}: it was run with other settings "
                         f"({', '.join(changed) or 'unknown'} differ); give the same flags or start over")
    return document


def _count(document: dict[str, Any]) -> int:
    rows = document.get("results", document.get("curve", []))
    return len(rows) if isinstance(rows, list) else 0
