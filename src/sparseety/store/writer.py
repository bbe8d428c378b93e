"""``TraceWriter``: a bounded queue and one background thread that batch rows and commit Parquet files.

The producer (a serving thread) only calls :meth:`TraceWriter.submit`, which never waits: when the
queue is full the record is dropped and counted. The thread converts records to rows (privacy and
sampling applied), batches them per table and partition, and commits a batch when it holds
``batch_rows`` rows or is ``flush_interval_s`` old. A batch's files are renamed into place and then its
commit manifest written, so readers see all of a batch's rows, in every table, or none.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from sparseety.errors import ConfigError, SparseetyError
from sparseety.store.commits import write_manifest
from sparseety.store.dataset import create_dataset, write_part
from sparseety.store.rows import RequestRows, StoreOptions, request_rows, to_table
from sparseety.store.sampling import check_rate, should_sample
from sparseety.store.tables import TABLES

if TYPE_CHECKING:
    from sparseety.engine.result import RunResult

_TABLE_ORDER = ("token_events", "important_tokens", "signals", "requests")


@dataclass(frozen=True)
class WriterStats:
    """Counters of one :class:`TraceWriter`.

    Attributes
    ----------
    accepted : records ``submit`` put on the queue.
    dropped_records : records ``submit`` dropped because the queue was full.
    committed_requests : requests whose rows are all in committed files.
    committed_files : Parquet files renamed into place.
    failed_records : accepted records lost to a conversion or write error.
    queue_depth : records waiting in the queue now.
    last_error : the most recent error in the writer thread, or None.
    """

    accepted: int
    dropped_records: int
    committed_requests: int
    committed_files: int
    failed_records: int
    queue_depth: int
    last_error: str | None


@dataclass(frozen=True)
class Commit:
    """One committed batch: its request ids and the files it added (``requests`` files last)."""

    request_ids: list[str]
    files: list[Path]


@dataclass
class _Item:
    result: RunResult
    sample_rate: float
    extra: dict[str, Any] | None
    created: float


POLL_S = 0.005
"""How often a paused writer thread looks whether it may go on."""
IDLE_WAIT_S = 1.0
"""Longest sleep of a writer thread with nothing queued or pending (producers wake it sooner)."""
PATHS_KEPT = 4096
"""How many recent requests :meth:`TraceWriter.path_of` remembers (bounded for long-running servers)."""


class TraceWriter:
    """Asynchronous, crash-safe writer of a trace dataset.

    Parameters
    ----------
    trace_dir : dataset root (created with its marker when missing).
    queue_size : most records waiting; beyond it ``submit`` drops and counts.
    redact : replace secrets in stored text with typed placeholders.
    ids_only : store token ids and no text at all.
    batch_rows : commit once a batch holds this many rows in any table.
    flush_interval_s : commit a batch at the latest this long after its first record.
    compression : Parquet codec (``zstd``; ``none`` lets tests read the raw bytes).
    on_commit : called in the writer thread after each committed batch.
    on_error : called in the writer thread with the error and the request ids whose traces it lost.
    """

    def __init__(
        self,
        trace_dir: str | Path,
        *,
        queue_size: int = 1024,
        redact: bool = False,
        ids_only: bool = False,
        batch_rows: int = 200_000,
        flush_interval_s: float = 1.0,
        compression: str = "zstd",
        on_commit: Callable[[Commit], None] | None = None,
        on_error: Callable[[BaseException, list[str]], None] | None = None,
    ) -> None:
        if queue_size <= 0:
            raise ConfigError(f"queue_size must be positive, got {queue_size}")
        if batch_rows <= 0 or flush_interval_s <= 0:
            raise ConfigError("batch_rows and flush_interval_s must be positive")
        self.root = create_dataset(trace_dir)
        self.options = StoreOptions(redact=redact, ids_only=ids_only)
        self.compression = compression
        self.batch_rows = batch_rows
        self.flush_interval_s = flush_interval_s
        self.on_commit = on_commit
        self.on_error = on_error
        self.queue_size = queue_size
        # A deque, not queue.Queue: append/popleft/len are atomic under the GIL and take no mutex the
        # writer thread could hold, so ``submit`` never blocks (a contended mutex would make the
        # producer wait for the GIL afterwards, up to the 5 ms switch interval).
        self._queue: deque[_Item] = deque()
        self._lock = threading.Lock()  # counters the writer thread updates, and drops
        self._dropped = 0
        self._taken = 0  # items the writer thread took off the queue (one consumer: no race)
        self._committed_requests = self._committed_files = self._failed = 0
        self._last_error: str | None = None
        self._paths: OrderedDict[str, Path] = OrderedDict()  # the newest PATHS_KEPT requests
        self._in_flight: dict[str, None] = {}  # accepted, not yet committed (or lost to an error)
        self._lost: OrderedDict[str, str] = OrderedDict()  # the newest PATHS_KEPT dropped or failed requests: why
        self._closed = False
        self._stop = threading.Event()
        self._flushes: deque[threading.Event] = deque()
        self._paused = threading.Event()
        self._idle = threading.Event()
        self._wake = threading.Event()  # set by producers, flush, pause, resume and close: no idle polling
        self._pending: list[RequestRows] = []
        self._pending_rows = 0
        self._pending_since = 0.0
        self._thread = threading.Thread(target=self._run, name="sparseety-trace-writer", daemon=True)
        self._thread.start()

    # -- producer side ---------------------------------------------------------------------------
    def submit(self, result: RunResult, *, sample_rate: float = 1.0, extra: dict[str, Any] | None = None) -> bool:
        """Queue ``result`` without waiting; False when the queue was full (dropped and counted).

        The request keeps its run's tier when ``should_sample(request_id, sample_rate)`` holds or it
        ran at tier 3 (forced); otherwise only its tier-1 part (counts, timings) is stored. Do not
        change ``result`` after submitting it. With several producer threads the queue may exceed
        ``queue_size`` by at most one record per producer.
        """
        if self._closed:
            raise SparseetyError("trace writer is closed")
        if len(self._queue) >= self.queue_size:
            with self._lock:  # producers only (and stats()): never held by the writer's hot path
                self._dropped += 1
                self._remember_lost([result.request_id], f"the trace writer's queue was full ({self.queue_size})")
            return False
        self._in_flight[result.request_id] = None  # a dict store: atomic, no lock on the producer's path
        self._queue.append(_Item(result, sample_rate, extra, time.time()))
        self._wake.set()
        return True

    def status(self, request_id: str) -> str | None:
        """Where a request's trace is: ``committed``, ``pending`` (accepted, not committed yet) or
        ``dropped`` (queue full or a write error), for the newest :data:`PATHS_KEPT` requests; else None."""
        with self._lock:
            if request_id in self._paths:
                return "committed"
            if request_id in self._in_flight:
                return "pending"
            return "dropped" if request_id in self._lost else None

    def drop_reason(self, request_id: str) -> str | None:
        """Why a ``dropped`` request's trace was lost (queue full, or the write error); else None."""
        with self._lock:
            return self._lost.get(request_id)

    def _remember_lost(self, request_ids: list[str], reason: str) -> None:
        """Under ``_lock``: these requests' traces will never be committed, because of ``reason``."""
        for request_id in request_ids:
            self._in_flight.pop(request_id, None)
            self._lost[request_id] = reason
        while len(self._lost) > PATHS_KEPT:
            self._lost.popitem(last=False)

    def stats(self) -> WriterStats:
        """A snapshot of the counters."""
        with self._lock:
            depth = len(self._queue)
            return WriterStats(
                accepted=self._taken + depth, dropped_records=self._dropped,
                committed_requests=self._committed_requests, committed_files=self._committed_files,
                failed_records=self._failed, queue_depth=depth, last_error=self._last_error,
            )

    def path_of(self, request_id: str) -> Path | None:
        """The committed ``requests`` file holding ``request_id``, for the newest :data:`PATHS_KEPT`
        requests this writer committed; else None."""
        with self._lock:
            return self._paths.get(request_id)

    def flush(self, timeout: float | None = None) -> bool:
        """Commit everything accepted so far; True when done within ``timeout`` seconds."""
        if not self._thread.is_alive():
            return not self._queue
        done = threading.Event()
        self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout)

    def pause(self) -> None:
        """Stop taking records off the queue (records keep being accepted until it is full)."""
        self._idle.clear()
        self._paused.set()
        self._wake.set()
        self._idle.wait()

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._paused.clear()
        self._wake.set()

    def close(self) -> WriterStats:
        """Commit everything accepted, stop the thread and return the final stats (idempotent)."""
        if not self._closed:
            self._closed = True
            self._paused.clear()
            self._stop.set()
            self._wake.set()
            self._thread.join()
        return self.stats()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- writer thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._paused.is_set() and not self._stop.is_set():
                self._idle.set()
                time.sleep(POLL_S)
                continue
            stopping = self._stop.is_set()  # read before draining: nothing accepted before close is missed
            flushes = [self._flushes.popleft() for _ in range(len(self._flushes))]
            if stopping or flushes:
                self._drain()
                self._commit()
                for done in flushes:
                    done.set()
                if stopping:
                    return
                continue
            if not self._queue:
                if self._pending and self._time_left() == 0.0:
                    self._commit()
                self._wake.clear()  # then look again: a record queued from here on sets it and ends the wait
                if not (self._queue or self._flushes or self._stop.is_set() or self._paused.is_set()):
                    self._wake.wait(self._time_left() if self._pending else IDLE_WAIT_S)
                continue
            self._take()
            if self._pending_rows >= self.batch_rows or self._time_left() == 0.0:
                self._commit()
            time.sleep(0)  # hand the GIL to a waiting producer now rather than after the switch interval

    def _take(self) -> None:
        item = self._queue.popleft()
        with self._lock:
            self._taken += 1
        self._add(item)

    def _drain(self) -> None:
        """Convert everything queued now, committing full batches on the way."""
        for _ in range(len(self._queue)):
            self._take()
            if self._pending_rows >= self.batch_rows:
                self._commit()

    def _time_left(self) -> float:
        if not self._pending:
            return self.flush_interval_s
        return max(0.0, self._pending_since + self.flush_interval_s - time.monotonic())

    def _add(self, item: _Item) -> None:
        try:
            rate = check_rate(item.sample_rate)
            rows = request_rows(
                item.result, self.options, sample_rate=rate,
                sampled=should_sample(item.result.request_id, rate), extra=item.extra,
                created_at=datetime.fromtimestamp(item.created, UTC),
            )
        except Exception as exc:
            self._fail(1, exc, [item.result.request_id])
            return
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(rows)
        self._pending_rows += rows.row_count()

    def _commit(self) -> None:
        batch, self._pending, self._pending_rows = self._pending, [], 0
        if not batch:
            return
        try:
            commit = commit_rows(self.root, batch, compression=self.compression)
        except Exception as exc:
            self._fail(len(batch), exc, [rows.request_id for rows in batch])
            return
        requests = [p for p in commit.files if p.parent.parent.name == "requests"]
        with self._lock:
            self._committed_requests += len(batch)
            self._committed_files += len(commit.files)
            for rows in batch:
                day = f"date={rows.created_at.date().isoformat()}"
                self._paths[rows.request_id] = next(p for p in requests if p.parent.name == day)
                self._in_flight.pop(rows.request_id, None)
            while len(self._paths) > PATHS_KEPT:
                self._paths.popitem(last=False)
        if self.on_commit is not None:
            try:
                self.on_commit(commit)
            except Exception as exc:
                self._record_error(exc)

    def _fail(self, count: int, exc: BaseException, request_ids: list[str] | tuple[str, ...] = ()) -> None:
        with self._lock:
            self._failed += count
            self._remember_lost(list(request_ids), f"the write failed: {type(exc).__name__}: {exc}")
        self._record_error(exc)
        if self.on_error is not None:
            try:
                self.on_error(exc, list(request_ids))
            except Exception as hook_exc:
                self._record_error(hook_exc)

    def _record_error(self, exc: BaseException) -> None:
        with self._lock:
            self._last_error = f"{type(exc).__name__}: {exc}"


def commit_rows(root: Path, batch: list[RequestRows], *, compression: str = "zstd") -> Commit:
    """Write ``batch`` as one file per table and day partition (``requests`` files last), then commit
    them all at once with one manifest."""
    by_day: dict[date, list[RequestRows]] = {}
    for rows in batch:
        by_day.setdefault(rows.created_at.date(), []).append(rows)
    files: list[Path] = []
    for table in _TABLE_ORDER:
        for day, group in sorted(by_day.items()):
            parts = [rows.tables[table] for rows in group if table in rows.tables]
            if parts:
                files.append(write_part(root, table, day, to_table(TABLES[table], parts), compression=compression))
    assert set(_TABLE_ORDER) == set(TABLES)
    write_manifest(root, files)
    return Commit(request_ids=[rows.request_id for rows in batch], files=files)


def write_trace(
    result: RunResult,
    trace_dir: str | Path,
    *,
    extra: dict[str, Any] | None = None,
    redact: bool = False,
    ids_only: bool = False,
    sample_rate: float = 1.0,
    created_at: datetime | None = None,
    compression: str = "zstd",
) -> Path:
    """Store ``result`` now (synchronously) and return its ``requests`` file.

    ``load_trace`` accepts that path (it names the request), as it accepts the dataset root.
    Errors raise here instead of being counted as in :class:`TraceWriter`.
    """
    root = create_dataset(trace_dir)
    rate = check_rate(sample_rate)
    rows = request_rows(
        result, StoreOptions(redact=redact, ids_only=ids_only), sample_rate=rate,
        sampled=should_sample(result.request_id, rate), extra=extra, created_at=created_at,
    )
    commit = commit_rows(root, [rows], compression=compression)
    return commit.files[-1]
