"""The ``sparseety`` command line: one Typer app; each command group lives in its own module."""

from __future__ import annotations

from sparseety.cli.app import app, main
from sparseety.cli import extract_cmd, models_cmd, policies_cmd, run_cmd  # noqa: F401  (registers the commands)

__all__ = ["app", "main"]
