"""The ``sparseety`` command line: one Typer app; each command group lives in its own ``*_cmd`` module."""

from __future__ import annotations

import importlib
import pkgutil

from sparseety.cli.app import app, main

# Importing a ``*_cmd`` module registers its commands on ``app``.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.endswith("_cmd")):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["app", "main"]
