"""The Typer app, its ``--version`` flag and the error boundary every command goes through."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.core import TyperGroup

from sparseety import __version__
from sparseety.models.offline import offline_hint, resolve_offline
from sparseety.errors import ModelLoadError, OutputSavedElsewhere, SparseetyError

class OneLineErrors(TyperGroup):
    """The root group: a command-line usage error (unknown option, value of the wrong type or out of
    range) is one ``error: ...`` line on stderr and exit code 2, not a framed block."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as exc:
            ctx = getattr(exc, "ctx", None)
            if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
                print(ctx.get_help())
                sys.exit(2)
            message = " ".join(str(exc.format_message()).split())  # type: ignore[attr-defined]
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print(f"error: {message}{hint}", file=sys.stderr)
            sys.exit(2 if ctx is not None else getattr(exc, "exit_code", 1))
        except typer.Abort:
            print("error: aborted", file=sys.stderr)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    name="sparseety",
    help="See the token flow of sparse LLM inference: what went in, what came out, what was evicted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> None:
    """Print ``error: message`` on stderr, on one line, and exit with ``code`` (2: bad input)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise typer.Exit(code)


def user_errors(fn: F) -> F:
    """Check every numeric flag's range (:mod:`sparseety.cli.bounds`), turn a :class:`SparseetyError` raised
    by a command into an ``error:`` line and exit code 2 (1 for a result saved elsewhere, see
    :func:`sparseety.output_paths.save_or_salvage`), and print each store warning (a skipped damaged
    file) once as a ``warning:`` line."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from sparseety.cli.bounds import check_bounds
        from sparseety.store.notices import collected

        try:
            check_bounds(kwargs)
            with collected(echo=True):
                return fn(*args, **kwargs)
        except OutputSavedElsewhere as exc:  # the work is kept, elsewhere: not a bad input
            fail(str(exc), code=1)
        except ModelLoadError as exc:
            hint = offline_hint()
            fail(f"{exc} ({hint})" if hint and hint not in str(exc) else str(exc))
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
    resolve_offline()


def main() -> None:
    """Console-script entry point."""
    app()
