"""``sparseety models list``."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import app
from sparseety.models import list_models

models_app = typer.Typer(help="Built-in models.", no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("list")
def models_list() -> None:
    """Name the built-in models (any Hugging Face id or local directory works too)."""
    table = Table("name", "architecture", "layers", "heads", "kv heads", "window", "source", "license")
    for m in list_models():
        table.add_row(m.name, m.architecture, str(m.layers), str(m.heads), str(m.kv_heads), m.window,
                      f"{m.install} ({m.gguf_file})", m.license)
    Console().print(table)
