"""The Typer app, its ``--version`` flag and the error boundary every command goes through."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from sparseety import __version__
from sparseety.errors import SparseetyError

app = typer.Typer(
    name="sparseety",
    help="See the token flow of sparse LLM inference: what went in, what came out, what was evicted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> None:
    """Print ``error: message`` on stderr and exit with ``code`` (2: bad input)."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def user_errors(fn: F) -> F:
    """Turn a :class:`SparseetyError` raised by a command into an ``error:`` line and exit code 2; print each
    store warning (a skipped damaged file) once as a ``warning:`` line."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from sparseety.store.notices import collected

        try:
            with collected(echo=True):
                return fn(*args, **kwargs)
        except SparseetyError as exc:
            fail(str(exc))

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        print(f"sparseety {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """SparSEEty command line."""


def main() -> None:
    """Console-script entry point."""
    app()
