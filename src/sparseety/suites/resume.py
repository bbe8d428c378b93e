"""Output that keeps what a long run did: the result document is rewritten (atomically) after every
finished case with ``"complete": false``, so a killed run leaves every finished case on disk, and
``--resume`` reads it back to continue without redoing them.

The document records the run's settings under ``"run"``; resuming with other settings is refused,
and so is starting over on top of an unfinished run without ``--resume``. The settings hold, under
``"inputs"``, the SHA-256 of every file the results depend on (passages, weights files), so a file whose
contents changed since is refused on ``--resume`` however its path reads, and never mixed into a result
marked complete.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from sparseety.errors import InputError
from sparseety.output_paths import save_or_salvage


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` atomically (a reader or a kill never sees half of it).

    When that fails (disk full, folder removed meanwhile) the document is saved elsewhere and
    :class:`~sparseety.errors.OutputSavedElsewhere` names where (:func:`~sparseety.output_paths.save_or_salvage`).
    """
    save_or_salvage(path, lambda target: _write_json(target, document), what="the results so far"
                    if document.get("complete") is False else "the result")


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(document, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def content_digest(path: Path, what: str) -> str:
    """``sha256:<hex>`` of the file's bytes; ``what`` names it (a flag) when it cannot be read."""
    import hashlib

    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return "sha256:" + digest.hexdigest()


def input_contents(files: Iterable[tuple[str, Path]]) -> dict[str, str]:
    """``{path: sha256}`` of ``(what, path)`` pairs, for the settings' ``"inputs"``."""
    return {str(path): content_digest(Path(path), what) for what, path in files}


def _changed_inputs(path: Path, ours: dict[str, str], theirs: Any) -> str | None:
    """Why the recorded inputs of ``path``'s run are not today's, or None when they are."""
    if not isinstance(theirs, dict):
        return (f"cannot resume from {path}: it does not record its input files' contents (written by an older "
                "version), so its results cannot be checked against today's files; delete it to start over")
    changed = sorted(k for k in ours if k in theirs and ours[k] != theirs[k])
    if changed:
        return (f"cannot resume from {path}: the contents of {', '.join(changed)} changed since its results were "
                "computed; restore the file, or delete the result to start over")
    return None


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
    theirs = document.get("run") if isinstance(document.get("run"), dict) else {}
    if "inputs" in run:
        why = _changed_inputs(path, run["inputs"], theirs.get("inputs"))
        if why:
            raise InputError(why)
    if document.get("run") != run:
        changed = sorted(k for k in set(run) | set(theirs) if run.get(k) != theirs.get(k))
        raise InputError(f"cannot resume from {path}: it was run with other settings "
                         f"({', '.join(changed) or 'unknown'} differ); give the same flags or start over")
    return document


def _count(document: dict[str, Any]) -> int:
    rows = document.get("results", document.get("curve", []))
    return len(rows) if isinstance(rows, list) else 0
