"""The one check of a path a command will write, made before any work, and the one way a result that still
cannot be saved afterwards is kept somewhere else.

:func:`check_output` refuses, with an :class:`~sparseety.errors.InputError` naming the flag, the path and the
real cause, what could not be written: an empty name; a missing parent under a file (``afile/x``); a directory
where a file is meant or a file where a directory is meant; a symbolic link loop or a broken link; a place
inside ``/proc`` or ``/sys``; a folder nothing can be created in (probed by really creating and removing a
file, so read-only mounts and immutable folders are caught where ``os.access`` says yes); too little free
space. It creates nothing.

:func:`save_or_salvage` runs a saver; when the save still fails after the work (disk full, folder removed
meanwhile) it saves the same result next to the requested path or in the system's temporary folder and
raises :class:`~sparseety.errors.OutputSavedElsewhere` naming both. Standard library only: the vLLM observer
imports this module too.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from sparseety.errors import InputError, OutputSavedElsewhere

Kind = Literal["file", "directory"]
FILE: Kind = "file"
DIRECTORY: Kind = "directory"
PSEUDO_FILE_SYSTEMS = ("/proc", "/sys")
"""Mount points of pseudo file systems: what is written there is not kept (or cannot be created at all)."""
MIN_FREE = 1 << 20
"""Free bytes :func:`check_output` asks for by default (the trace store asks for more)."""


def check_output(path: str | os.PathLike[str], kind: Kind, flag: str, *, min_free: int = MIN_FREE,
                 name: str | None = None) -> Path:
    """Refuse, before any work, a path that a ``kind`` (file or directory) could not be written to.

    Parameters
    ----------
    path : where the command will write (need not exist; missing parent folders may be created later).
    kind : ``"file"`` (a file is written at ``path``, via a temporary file in its folder) or ``"directory"``
        (``path`` is a folder files are written into).
    flag : the user-facing flag or setting, e.g. ``"-o"`` or ``"--trace-dir"``.
    min_free : free bytes the file system must have.
    name : how messages name the path (default ``"{flag} {path}"``).

    Returns
    -------
    Path
        ``path`` as a :class:`~pathlib.Path`.

    Raises
    ------
    InputError
        Naming the flag, the path and why it cannot be written. Nothing is created.
    """
    text = os.fspath(path)
    if not text.strip():
        raise InputError(f"{flag} is empty; give a {'file name' if kind == FILE else 'directory'}")
    target = Path(text)
    label = name or (f"{flag} {text}" if text.isprintable() else f"{flag} {text!r}")
    state = _stat(target, label)
    if state == "broken":
        raise InputError(f"{label} is a broken symbolic link (to {os.readlink(target)})")
    if state is not None:
        if kind == FILE and target.is_dir():
            raise InputError(f"{label} is a directory; give a file name")
        if kind == DIRECTORY and not target.is_dir():
            raise InputError(f"{label} is not a directory")
        if kind == FILE and not target.is_file():
            raise InputError(f"{label} is not a regular file (a device, pipe or socket)")
        _refuse_pseudo(target, label)
    if kind == DIRECTORY and state is not None:
        folder, writes = target, "file"  # files are created in it
    else:
        folder = next(p for p in target.absolute().parents if _stat(p, label) is not None)  # "/" exists
        if not folder.is_dir():
            what = "a file, not a directory" if folder.is_file() else "not a directory"
            raise InputError(f"{label} cannot be created: {folder} is {what}")
        _refuse_pseudo(folder, label)
        writes = "file" if kind == FILE and folder == target.absolute().parent else "directory"
    try:  # really create one: a read-only mount or an immutable folder passes os.access
        if writes == "file":
            fd, probe = tempfile.mkstemp(prefix=".sparseety-check-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".sparseety-check-", dir=folder))
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        where = "is not writable" if folder == target else f"cannot be created in {folder}"
        raise InputError(f"{label} {where}: {exc.strerror or exc}") from None
    if free < min_free:
        raise InputError(f"{label} has {free >> 20} MiB free, less than the {min_free >> 20} MiB it must have")
    return target


def save_or_salvage(target: str | os.PathLike[str], save: Callable[[Path], object], *, what: str = "the result",
                    flag: str | None = None) -> Path:
    """``save(target)``; when that fails, ``save`` the same result elsewhere and say where.

    The fallback is a new file next to ``target`` (``<stem>.salvaged-XXXX<suffix>``), else one in the system's
    temporary folder (:func:`tempfile.mkstemp`). ``save`` must write a whole file at the path it is given
    (replacing an empty one).

    Returns
    -------
    Path
        ``target``, when the save worked.

    Raises
    ------
    OutputSavedElsewhere
        The save failed and ``what`` was saved at ``.fallback`` instead (the message names both paths).
    InputError
        The save failed and so did both fallbacks (every reason named).
    """
    requested = Path(target)
    try:
        save(requested)
        return requested
    except Exception as exc:  # an OSError, or a writer's own error type (safetensors raises SafetensorError)
        first = _reason(exc)
    where = f"{flag} {requested}" if flag else str(requested)
    reasons = []
    stem, suffix = requested.stem or "result", requested.suffix
    for folder in (requested.parent, Path(tempfile.gettempdir())):
        try:
            fd, spare = tempfile.mkstemp(prefix=f"{stem}.salvaged-", suffix=suffix, dir=folder)
            os.close(fd)
        except OSError as exc:
            reasons.append(f"{folder}: {_reason(exc)}")
            continue
        try:
            save(Path(spare))
        except Exception as exc:
            Path(spare).unlink(missing_ok=True)
            reasons.append(f"{folder}: {_reason(exc)}")
            continue
        raise OutputSavedElsewhere(f"cannot write {where}: {first}; saved {what} to {spare} instead", Path(spare))
    raise InputError(f"cannot write {where}: {first}; {what} could not be saved elsewhere either "
                     f"({'; '.join(reasons)})")


def _stat(path: Path, label: str) -> str | None:
    """``"ok"`` when ``path`` exists, ``"broken"`` for a link to nothing, None when nothing is there."""
    try:
        os.stat(path)
        return "ok"
    except ValueError as exc:  # an embedded NUL byte
        raise InputError(f"{label} cannot be used: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            loop = _loop(path)
            raise InputError(f"{label} is a symbolic link loop" if loop == path.absolute() else
                             f"{label} cannot be used: {loop} is a symbolic link loop") from None
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # EACCES, ENAMETOOLONG, EIO...
            raise InputError(f"{label} cannot be used: {exc.strerror or exc}") from None
    return "broken" if os.path.islink(path) else None


def _loop(path: Path) -> Path:
    """The first part of ``path`` that is a symbolic link loop."""
    for part in (*reversed(path.absolute().parents), path.absolute()):
        try:
            os.stat(part)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return part
    return path


def _refuse_pseudo(path: Path, label: str) -> None:
    """Refuse ``path`` when it is written, or resolves to, a place inside a pseudo file system."""
    places = (os.path.abspath(path), os.path.realpath(path))
    for root in PSEUDO_FILE_SYSTEMS:
        if any(place == root or place.startswith(root + "/") for place in places):
            raise InputError(f"{label} is inside {root}, a pseudo file system that keeps no files; "
                             "choose a path on disk")


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return text or type(exc).__name__
