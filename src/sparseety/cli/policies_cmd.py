"""``sparseety policies list``."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from sparseety.cli.app import app
from sparseety.policies import list_policies, policy_options

policies_app = typer.Typer(help="KV-cache policies.", no_args_is_help=True)
app.add_typer(policies_app, name="policies")


@policies_app.command("list")
def policies_list() -> None:
    """Name every policy with its options (set them with --policy-opt key=value)."""
    table = Table("policy", "what it does", "options (default)", "evicts")
    for cls in list_policies():
        options = ", ".join(f"{k}={v}" for k, v in policy_options(cls).items()) or "-"
        table.add_row(cls.name, cls.summary, options, "yes" if cls.evicts else "no")
    Console().print(table)
