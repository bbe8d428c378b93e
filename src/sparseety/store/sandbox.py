"""The SQL sandbox: a DuckDB connection that reads the dataset's files and nothing else.

:func:`lock_down` runs after the views are created: it allows exactly the dataset's committed files,
switches external access off (no other file, URL, database or extension) and locks the configuration
so no statement can switch it back. :func:`check_sql` refuses, before running anything, every
statement but a query (``SELECT``, ``WITH``, ``DESCRIBE``, ``SUMMARIZE``, ``EXPLAIN``).

Every connection is bounded by :class:`SqlLimits` (:func:`apply_limits`, before the lock): DuckDB's
``memory_limit`` and ``threads``, no spilling to disk, and, inside :func:`watching`, a statement timeout
(DuckDB has none: a timer interrupts the connection). A statement that passes a limit raises
:class:`~sparseety.errors.QueryLimitError` naming the limit and the flag that raises it.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import duckdb

from sparseety.errors import ConfigError, InputError, QueryLimitError

P = ParamSpec("P")
T = TypeVar("T")
MIN_MEMORY, MAX_MEMORY = 1 << 20, 1 << 50  #: 1 MiB .. 1 PiB
MAX_THREADS = 256
MAX_TIMEOUT = 86_400.0  #: one day
LIMIT_ERRORS = (duckdb.InterruptException, duckdb.OutOfMemoryException)  #: what a passed limit raises
FETCH_ROWS = 1024  #: rows fetched at a time, so the timeout and the memory limit hold while rows arrive


@dataclass(frozen=True)
class SqlLimits:
    """Bounds of one sandboxed SQL call.

    Attributes
    ----------
    memory_limit : bytes DuckDB may use (``SET memory_limit``, no spilling to disk); the rows a query
        returns to Python count against it too.
    threads : DuckDB worker threads (``SET threads``).
    timeout : seconds a call may run before its connections are interrupted.
    server : the server's limits (messages name ``sparseety serve``'s flags).
    """

    memory_limit: int = 1 << 30
    threads: int = 2
    timeout: float = 30.0
    server: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        check_limits(self.memory_limit, self.threads, self.timeout)

    def _flag(self, name: str) -> str:
        return f"`sparseety serve --sql-{name}`" if self.server else f"--sql-{name}"

    def timeout_error(self) -> QueryLimitError:
        return QueryLimitError(f"query stopped after {self.timeout:g} s (the statement timeout; "
                               f"{self._flag('timeout')} raises it)", "timeout")

    def memory_error(self, what: str = "it needed") -> QueryLimitError:
        return QueryLimitError(f"query stopped: {what} more than {size_text(self.memory_limit)} (the memory limit; "
                               f"{self._flag('memory-limit')} raises it)", "memory")


def check_limits(memory_limit: object, threads: object, timeout: object,
                 names: tuple[str, str, str] = ("sql_memory_limit", "sql_threads", "sql_timeout"),
                 memory_text: object = None) -> None:
    """Refuse limits out of range; :class:`ConfigError` names the field (``names``), the value (``memory_text``:
    the size as written) and the range."""
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or not MIN_MEMORY <= memory_limit <= MAX_MEMORY:
        shown = memory_limit if memory_text is None else memory_text
        raise ConfigError(f"{names[0]} must be between 1 MiB and 1 PiB, got {shown!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"{names[1]} must be an integer from 1 to {MAX_THREADS}, got {threads!r}")
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT):
        raise ConfigError(f"{names[2]} must be more than 0 and at most {MAX_TIMEOUT:g} seconds, got {timeout!r}")


CLI_LIMITS = SqlLimits()  #: ``query``, ``traces``, ``report``: 1 GiB, 2 threads, 30 s (``ServeConfig`` has the server's)

_LIMITS: ContextVar[SqlLimits] = ContextVar("sparseety_sql_limits", default=CLI_LIMITS)
_WATCH: ContextVar[Watch | None] = ContextVar("sparseety_sql_watch", default=None)


def size_text(n: int) -> str:
    """``n`` bytes as ``1.0 GiB`` / ``64.0 MiB`` / ``512.0 KiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def current_limits() -> SqlLimits:
    """The limits in force: the active :func:`watching` call's, else :func:`using`'s, else :data:`CLI_LIMITS`."""
    watch = _WATCH.get()
    return watch.limits if watch is not None else _LIMITS.get()


@contextmanager
def using(limits: SqlLimits) -> Iterator[None]:
    """Make ``limits`` the ones in force inside the block (for readers called deep inside a command)."""
    token = _LIMITS.set(limits)
    try:
        yield
    finally:
        _LIMITS.reset(token)


class Watch:
    """The timer of one bounded call: when it passes the timeout, every connection opened in it is interrupted."""

    def __init__(self, limits: SqlLimits) -> None:
        self.limits = limits
        self.fired = threading.Event()
        self._connections: list[duckdb.DuckDBPyConnection] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(limits.timeout, self._stop)
        self._timer.daemon = True

    def add(self, con: duckdb.DuckDBPyConnection) -> None:
        with self._lock:
            self._connections.append(con)
            if self.fired.is_set():
                con.interrupt()

    def _stop(self) -> None:
        with self._lock:
            self.fired.set()
            for con in self._connections:
                try:
                    con.interrupt()
                except duckdb.Error:  # closed already
                    pass

    def check(self) -> None:
        """Raise the timeout error once the timer has fired (between Python-side steps)."""
        if self.fired.is_set():
            raise self.limits.timeout_error()


@contextmanager
def watching(limits: SqlLimits | None = None) -> Iterator[Watch]:
    """Bound the block by ``limits`` (default: :func:`current_limits`): connections it opens get them, the
    timeout interrupts them, and an interrupt or DuckDB's out-of-memory error leaves as :class:`QueryLimitError`."""
    watch = Watch(limits if limits is not None else current_limits())
    token = _WATCH.set(watch)
    watch._timer.start()
    try:
        yield watch
        watch.check()  # past the timeout, a statement may have been cut short: its result does not count
    except QueryLimitError:
        raise
    except Exception as exc:  # readers wrap DuckDB's errors (RecordError, Arrow's OSError): look through them
        if watch.fired.is_set():
            raise watch.limits.timeout_error() from None
        if _out_of_memory(exc):
            raise watch.limits.memory_error() from None
        raise
    finally:
        watch._timer.cancel()
        _WATCH.reset(token)


def bounded(fn: Callable[P, T]) -> Callable[P, T]:
    """Run ``fn`` inside :func:`watching`, with its ``limits`` argument when it has one and it is given."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        limits = signature.bind(*args, **kwargs).arguments.get("limits")
        with watching(limits):
            return fn(*args, **kwargs)

    return wrapper


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, duckdb.OutOfMemoryException) or "Out of Memory Error:" in str(exc)


def apply_limits(con: duckdb.DuckDBPyConnection) -> None:
    """Set :func:`current_limits` on ``con`` (before :func:`lock_down`) and let the active watch interrupt it."""
    limits = current_limits()
    con.execute(f"SET memory_limit = '{limits.memory_limit}B'")
    con.execute(f"SET threads = {limits.threads}")
    con.execute("SET temp_directory = ''")  # no spilling: a runaway query cannot fill the disk
    con.execute("SET max_temp_directory_size = '0KiB'")
    watch = _WATCH.get()
    if watch is not None:
        watch.add(con)


def fetch_rows(con: duckdb.DuckDBPyConnection, watch: Watch) -> list[tuple[Any, ...]]:
    """The rows of the statement ``con`` just executed, fetched a few at a time so the timeout holds and
    their Python size stays under the memory limit."""
    rows: list[tuple[Any, ...]] = []
    size = 0
    while True:
        chunk = con.fetchmany(FETCH_ROWS)
        watch.check()
        if not chunk:
            return rows
        size += sum(_py_size(row) for row in chunk)
        if size > watch.limits.memory_limit:
            raise watch.limits.memory_error("its result needs")
        rows.extend(chunk)


def _py_size(value: object) -> int:
    """A rough size in bytes of ``value`` as Python objects (what the rows cost once fetched)."""
    if isinstance(value, (list, tuple)):
        return 56 + 8 * len(value) + sum(_py_size(v) for v in value)
    if isinstance(value, dict):
        return 232 + sum(_py_size(k) + _py_size(v) for k, v in value.items())
    if isinstance(value, (str, bytes)):
        return 49 + len(value)
    return 32

ALLOWED = frozenset({duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN})


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def lock_down(con: duckdb.DuckDBPyConnection, files: list[Path]) -> None:
    """Allow only ``files``, switch external access off and lock the configuration of ``con`` (its
    :func:`apply_limits` included)."""
    allowed = "[" + ", ".join(_literal(str(p)) for p in files) + "]"
    con.execute(f"SET allowed_paths = {allowed}")
    con.execute("SET allowed_directories = []")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def check_sql(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Refuse ``sql`` unless it is exactly one read-only query.

    Raises
    ------
    InputError
        Malformed SQL, no statement, several statements, or one that writes, attaches, installs,
        loads, exports, sets or calls (named in the message).
    """
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise InputError(f"malformed SQL: {_first_line(exc)}") from None
    if not statements:
        raise InputError("no SQL statement given; give a query (SELECT ...)")
    if len(statements) > 1:
        raise InputError(f"give one SQL statement at a time, got {len(statements)} (run each separately)")
    statement = statements[0]
    if statement.type not in ALLOWED:
        words = statement.query.split()
        name = words[0].upper() if words else str(statement.type).rsplit(".", 1)[-1]
        raise InputError(f"{name} statements are not allowed: query reads the trace dataset only "
                         "(SELECT, WITH, DESCRIBE, SUMMARIZE, EXPLAIN)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
