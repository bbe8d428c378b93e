"""A stored run's report inline in a notebook: ``show(load_trace("traces"))`` as a cell's last line.

The view lives here, above the store, so that the store never imports the report (the store's
:class:`~sparseety.store.StoredTrace` is data; how it is drawn is the report's job).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparseety.report.html import render_html
from sparseety.store import StoredTrace


@dataclass(frozen=True)
class InlineReport:
    """The report of ``trace`` (at ``layer``, None: all layers) that Jupyter draws inline (``_repr_html_``)."""

    trace: StoredTrace
    layer: int | None = None

    def _repr_html_(self) -> str:
        return render_html(self.trace, layer=self.layer)


def show(trace: StoredTrace, *, layer: int | None = None) -> InlineReport:
    """The report of one stored run, drawn inline when a notebook cell returns it."""
    return InlineReport(trace, layer)
