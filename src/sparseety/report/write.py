"""Write a report file (and PNG figures) from any report source."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from sparseety.errors import InputError
from sparseety.report.bench_data import bench_view
from sparseety.report.data import trace_view
from sparseety.report.html import render_view
from sparseety.report.sources import load_source
from sparseety.store import StoredTrace

REPORTS_DIR = "reports"
DATASET_MARKER = "_sparseety_dataset.json"  #: the file at the root of a trace dataset


def report_view(source: StoredTrace | str | Path, *, layer: int | None = None,
                request_id: str | None = None) -> tuple[dict[str, Any], StoredTrace | None, Path | None]:
    """``(view, trace or None, path of a JSON source or None)`` for ``source``."""
    loaded = load_source(source, request_id)
    if isinstance(loaded, StoredTrace):
        return trace_view(loaded, layer=layer), loaded, None
    return bench_view(loaded), None, Path(source)


def default_report_path(trace: StoredTrace | None, json_source: Path | None) -> Path:
    """Where a report goes without ``-o``: ``<trace dataset>/reports/<request id>.html``, or beside a JSON source."""
    if trace is None:
        assert json_source is not None
        return json_source.with_suffix(".html")
    base = trace.path if trace.path.is_dir() else trace.path.parent
    for folder in (base, *base.parents):
        if (folder / DATASET_MARKER).is_file():
            base = folder
            break
    return base / REPORTS_DIR / f"{trace.request_id}.html"


def write_report(source: StoredTrace | str | Path, out: str | Path | None = None, *, layer: int | None = None,
                 request_id: str | None = None) -> Path:
    """Render the report of ``source`` and write it (atomically) to ``out`` or the default path.

    Parameters
    ----------
    source : a StoredTrace, a trace path or trace directory, or a passkey / tune JSON file.
    out : output file (default: :func:`default_report_path`).
    layer : layer selected when the page opens (None: all layers).
    request_id : which run of a trace directory (None: the newest).
    """
    view, trace, json_source = report_view(source, layer=layer, request_id=request_id)
    target = Path(out) if out is not None else default_report_path(trace, json_source)
    write_html(target, render_view(view))
    return target


def write_pngs(source: StoredTrace | str | Path, directory: str | Path, *, layer: int | None = None,
               request_id: str | None = None) -> list[Path]:
    """Write the report's figures as PNG files into ``directory``; returns their paths."""
    from sparseety.report.plots import save_figures

    view, _, _ = report_view(source, layer=layer, request_id=request_id)
    return save_figures(view, Path(directory))


def write_html(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` atomically (temporary file in the same folder, then rename), with the
    permissions any new file of the user's gets (its umask), where ``mkstemp`` would make it owner-only."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the user's umask applies, as to any file
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except OSError as exc:
        raise InputError(f"cannot write the report to {target}: {exc}") from None
