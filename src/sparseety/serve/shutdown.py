"""Running the app under uvicorn with a quiet shutdown.

The first SIGINT or SIGTERM prints one line and stops the server: no new connections, new requests
get 503, running ones end with a 503 error at the end of the current engine step, the trace writer
flushes, and the process exits 0 with no traceback (uvicorn alone re-raises the signal after its
shutdown: a ``KeyboardInterrupt`` traceback, or death by SIGTERM). A second signal skips the wait for
open connections.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _main_thread() -> bool:
    """Signal handlers can only be set from the main thread."""
    return threading.current_thread() is threading.main_thread()


class QuietServer(uvicorn.Server):
    """A uvicorn server that handles SIGINT and SIGTERM itself and calls ``on_stop`` when it begins to stop."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop
        self.stop_signal: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not _main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self._signalled) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _signalled(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.stop_signal = self.stop_signal or sig
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.stop_signal is not None:
            print(f"sparseety serve: {signal.Signals(self.stop_signal).name} received, shutting down (running "
                  "requests end with a 503 error)", file=sys.stderr, flush=True)
        self.on_stop()
        await super().shutdown(sockets)


def serve_until_stopped(app: Any, *, host: str, port: int, log_level: str) -> None:
    """Serve ``app`` (from :func:`~sparseety.serve.create_app`) until SIGINT or SIGTERM, then stop quietly."""
    state = app.state.serve
    server = QuietServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), on_stop=state.stop)
    original = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS} if _main_thread() else {}
    try:
        server.run()  # installs its own handlers while it runs
    finally:
        state.close()  # after a forced exit the app's own shutdown did not run
        if server.stop_signal is None:  # else stay deaf to signals: the interpreter's exit would die of a second one
            for sig, handler in original.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`KeyboardInterrupt` inside the block (model loading), as SIGINT does."""
    if not _main_thread():
        yield
        return

    def interrupt(sig: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    original = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, original)
