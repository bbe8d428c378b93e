"""Bounded admission and worker threads: model compute runs here, never on the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """Every worker is busy and the waiting queue is full."""


class Scheduler:
    """Runs jobs on ``max_concurrency`` threads with at most ``max_queue`` admitted jobs waiting.

    A request calls :meth:`admit` before it answers anything (so a full server says 429 at once), then
    awaits :meth:`run`. Each admission is released exactly once: when its job ends, or when the caller
    gives up before the job started.
    """

    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sparseety-generate")
        self._capacity = max_concurrency + max_queue
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0

    @property
    def running(self) -> int:
        """Jobs executing now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Admitted jobs not yet started."""
        with self._lock:
            return self._admitted - self._running

    def admit(self) -> None:
        """Reserve a place; raises :class:`QueueFull` when there is none."""
        with self._lock:
            if self._admitted >= self._capacity:
                raise QueueFull
            self._admitted += 1

    def release(self) -> None:
        """Give back an admission whose job will never run."""
        with self._lock:
            self._admitted -= 1

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a worker thread (after :meth:`admit`) and await its result."""

        def job() -> T:
            with self._lock:
                self._running += 1
            try:
                return fn()
            finally:
                with self._lock:
                    self._running -= 1
                    self._admitted -= 1

        future = self._executor.submit(job)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancel():  # never started: its admission is still held
                self.release()
            raise

    def shutdown(self) -> None:
        """Finish running jobs and stop the threads."""
        self._executor.shutdown(wait=True, cancel_futures=True)
