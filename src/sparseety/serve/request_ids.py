"""One id, one trace: the request ids a server refuses to run twice.

An id is *in use* while a request with it is queued or generating, and for good once a request with it
finished on a server with a trace store (its row is stored) or is already in that store when the server
starts. A request with an id in use is refused with 409 before any work; a request refused or stopped
before it finished leaves its id free again. Every method runs on the event loop's thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sparseety.serve.errors import APIError


class RequestIds:
    """The ids in flight on this server and the ids its trace store holds (None: no store)."""

    def __init__(self, stored: Iterable[str] | None) -> None:
        self._stored: set[str] | None = None if stored is None else set(stored)
        self._live: set[str] = set()

    def claim(self, request_id: str) -> None:
        """Take ``request_id`` for a new request; :class:`APIError` 409 when it is in use."""
        if request_id in self._live:
            where = "a request with this id is still running"
        elif self._stored is not None and request_id in self._stored:
            where = "a request with this id is stored in the trace store"
        else:
            self._live.add(request_id)
            return
        raise APIError(409, f"X-Request-Id {request_id!r} is already in use: {where}; send a new id (or none, and "
                       "the server makes one)", param="X-Request-Id", code="request_id_in_use")

    def release(self, request_id: str, *, finished: bool) -> None:
        """The request ended; with ``finished`` (it ran to the end) and a trace store, its id stays taken."""
        self._live.discard(request_id)
        if finished and self._stored is not None:
            self._stored.add(request_id)


def stored_request_ids(trace_dir: Path) -> set[str]:
    """Every request id in the trace store at ``trace_dir`` (one column read once, at startup)."""
    from sparseety.store import connect

    con = connect(trace_dir)
    try:
        return {row[0] for row in con.execute("SELECT DISTINCT request_id FROM requests").fetchall()}
    finally:
        con.close()
