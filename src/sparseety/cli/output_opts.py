"""Parsers of the flags that name a path a command writes, and the start-up check of those paths.

Typer turns ``--trace-dir ""`` into ``Path("")``, which is ``Path(".")``: the current folder. The parsers see the
text the user typed, so an empty path (and a file name ending in ``/``) is refused there, as one ``error:`` line
naming the flag, before anything runs. Every other check of an output path is
:func:`sparseety.output_paths.check_output`, which each writing command calls before its model loads
(:func:`check_outputs`).
"""

from __future__ import annotations

from pathlib import Path

import typer

from sparseety.output_paths import DIRECTORY, FILE, Kind, check_output


def output_file(value: str | Path) -> Path:
    """Typer ``parser`` of a flag naming a file to write: refuses an empty name and a name ending in ``/``."""
    if isinstance(value, Path):  # a default
        return value
    if not value.strip():
        raise typer.BadParameter("is empty; give a file name")
    if value.endswith("/"):
        raise typer.BadParameter(f"{value} ends in '/', a directory; give a file name")
    return Path(value)


def output_dir(value: str | Path) -> Path:
    """Typer ``parser`` of a flag naming a directory to write into: refuses an empty name (not the current one)."""
    if isinstance(value, Path):
        return value
    if not value.strip():
        raise typer.BadParameter("is empty; give a directory (`.` for the current one)")
    return Path(value)


def check_outputs(flag: str, path: Path | None, kind: Kind, files: tuple[str, ...] = ()) -> None:
    """Check, before any work, that ``path`` (a ``kind``) and the ``files`` a command writes in it can be written.

    A None ``path`` (an output not asked for) passes. Raises :class:`~sparseety.errors.InputError` naming ``flag``.
    """
    if path is None:
        return
    check_output(path, kind, flag)
    for name in files if kind == DIRECTORY else ():
        check_output(path / name, FILE, flag)


__all__ = ["DIRECTORY", "FILE", "check_outputs", "output_dir", "output_file"]
