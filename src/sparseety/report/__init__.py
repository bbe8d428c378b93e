"""Reports people can look at: one self-contained HTML file per run (or bench / tune result), and PNG figures.

``write_report(source)`` takes a :class:`~sparseety.store.StoredTrace`, a trace path or directory, or a
``bench passkey`` / ``tune`` JSON file; ``render_html(trace)`` returns the HTML of one stored run, and
``show(trace)`` draws it inline in Jupyter.
"""

from sparseety.report.html import render_html, render_view
from sparseety.report.notebook import InlineReport, show
from sparseety.report.write import (
    default_report_path,
    report_view,
    write_pngs,
    write_report,
)

__all__ = [
    "InlineReport",
    "default_report_path",
    "render_html",
    "render_view",
    "report_view",
    "show",
    "write_pngs",
    "write_report",
]
