"""The one wire between vLLM's processes and the observer: frames, the sender and the inbox.

A frame is one msgpack array ``[kind, version, [message, ...]]`` of messages of one kind
(:mod:`..vllm_api.wire_messages`), each a map of its dataclass's fields. :class:`WireSender` PUSHes frames
without ever blocking (a full queue drops the frame and counts its messages); :class:`WireInbox` binds the
PULL end in a daemon thread and hands each frame's messages to the one handler of their kind. A frame of an
unknown kind or version, or whose messages do not fit their dataclass, is counted (:attr:`WireInbox.counts`)
and dropped, never raised; a handler that raises costs its frame, counted, and the inbox goes on.
msgspec and pyzmq are imported when a socket opens; :func:`encode` and :func:`decode` need only msgspec.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sparseety.integrations.vllm.vllm_api.wire_messages import KINDS, Message

log = logging.getLogger("sparseety.vllm")
DROP_REASONS = ("unknown", "bad", "failed")  #: why an inbox dropped a frame (see :meth:`WireInbox.receive`)


class WireError(ValueError):
    """A frame that cannot be read: ``reason`` is ``unknown`` (kind or version) or ``bad`` (its layout)."""

    def __init__(self, reason: str, message: str, count: int = 1) -> None:
        super().__init__(message)
        self.reason = reason
        self.count = count  #: messages it held, where known


def encode(messages: Iterable[Message]) -> list[bytes]:
    """One frame per kind in ``messages``, kinds in first-seen order, messages in their order."""
    return [frame for frame, _ in _frames(messages)]


def _frames(messages: Iterable[Message]) -> list[tuple[bytes, int]]:
    """:func:`encode`'s frames, each with the number of messages it holds."""
    import msgspec

    by_kind: dict[type, list[Message]] = defaultdict(list)
    for message in messages:
        by_kind[type(message)].append(message)
    return [(msgspec.msgpack.encode((cls.KIND, cls.VERSION, batch)), len(batch)) for cls, batch in by_kind.items()]


def decode(frame: bytes) -> list[Message]:
    """The messages of one frame; :class:`WireError` when its kind or version is unknown or it does not fit."""
    import msgspec

    try:
        kind, version, raw = msgspec.msgpack.decode(frame, type=tuple[str, int, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError("bad", f"not a frame: {e}") from None
    cls = KINDS.get(kind)
    if cls is None or version != cls.VERSION:
        known = f"version {cls.VERSION}" if cls is not None else "no such kind"
        raise WireError("unknown", f"message kind {kind[:40]!r} version {version} ({known})")
    try:
        return msgspec.msgpack.decode(raw, type=list[cls])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError("bad", f"{kind} messages that do not fit {cls.__name__}: {e}") from None


class WireSender:
    """PUSH frames to ``endpoint(client)`` (one socket per client, opened on first use), never blocking: a full
    queue, or a socket that cannot open, drops the frame and counts its messages in :attr:`dropped`."""

    def __init__(self, endpoint: Callable[[int], str | None], *, hwm: int = 1000, linger_ms: int = 0) -> None:
        self._endpoint = endpoint
        self._hwm = hwm
        self._linger = linger_ms
        self._sockets: dict[int, Any] = {}
        self.dropped = 0  #: messages not sent (the receiver's queue was full, or no socket)
        self.sent = 0  #: messages handed to ZMQ

    def _socket(self, client: int) -> Any:
        """The PUSH socket to ``client``'s endpoint; None (tried once, then every frame to it drops, counted)
        when it has none or the socket cannot open."""
        if client in self._sockets:
            return self._sockets[client]
        import zmq

        sock = None
        endpoint = self._endpoint(client)
        if endpoint:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            try:
                sock.setsockopt(zmq.SNDHWM, self._hwm)
                sock.setsockopt(zmq.LINGER, self._linger)
                sock.connect(endpoint)
            except zmq.ZMQError as e:
                log.warning("sparseety: cannot open a channel to %s (%s); what goes there is dropped and counted",
                            endpoint, e)
                sock.close(0)
                sock = None
        self._sockets[client] = sock
        return sock

    def send(self, messages: Iterable[Message], client: int = 0) -> None:
        """Send ``messages`` to API server ``client`` (0: the only one, or API server 0)."""
        import zmq

        for frame, count in _frames(messages):
            sock = self._socket(client)
            try:
                if sock is None:
                    raise zmq.Again()
                sock.send(frame, zmq.NOBLOCK)
                self.sent += count
            except zmq.Again:
                self.dropped += count

    def close(self) -> None:
        """Close every socket (frames still queued go within the linger time)."""
        for sock in self._sockets.values():
            if sock is not None:
                sock.close()
        self._sockets.clear()


class WireInbox:
    """The PULL end of one channel: a daemon thread hands each frame's messages to ``handlers[type]``."""

    def __init__(self, endpoint: str, handlers: Mapping[type, Callable[[list[Any]], None]], *, name: str,
                 hwm: int = 10_000, start: bool = True) -> None:
        self.endpoint = endpoint
        self.name = name  #: the channel's name in logs and counts (``scheduler``, ``importance``, ``routing``)
        self.handlers = dict(handlers)
        self.hwm = hwm
        self.counts = {"received": 0, **{reason: 0 for reason in DROP_REASONS}}  #: frames
        self.error: str | None = None  #: why the socket could not bind (the thread then ended)
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"sparseety-vllm-{name}", daemon=True)
        if start:
            self.thread.start()

    def receive(self, frame: bytes) -> bool:
        """Decode one frame and hand its messages to their handler; False when it was counted and dropped."""
        try:
            messages = decode(frame)
            handler = self.handlers.get(type(messages[0])) if messages else None
        except WireError as e:
            return self._drop(e.reason, str(e))
        if not messages:
            self.counts["received"] += 1
            return True
        if handler is None:
            return self._drop("unknown", f"no handler for {type(messages[0]).__name__}")
        try:
            handler(messages)
        except Exception as e:
            return self._drop("failed", f"{type(messages[0]).__name__} handler: {type(e).__name__}: {e}")
        self.counts["received"] += 1
        return True

    def _drop(self, reason: str, why: str) -> bool:
        self.counts[reason] += 1
        try:
            from sparseety.integrations.vllm.transport.metrics import metrics

            metrics().wire_dropped.labels(channel=self.name, reason=reason).inc()
        except Exception:  # the count above holds; a metric never costs the inbox
            pass
        if reason not in self._logged:  # one line per reason and channel, then only counted
            self._logged.add(reason)
            log.warning("sparseety: the %s channel dropped a frame (%s; later ones are counted in "
                        "sparseety:wire_frames_dropped_total{channel=%r, reason=%r})", self.name, why, self.name, reason)
        return False

    def _run(self) -> None:
        import zmq

        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self.error = f"{type(e).__name__}: {e}"
            log.error("sparseety: cannot bind the %s channel %s (%s)", self.name, self.endpoint, self.error)
            sock.close(0)
            return
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self.receive(sock.recv())
        except Exception:
            log.exception("sparseety: the %s channel's receiver stopped", self.name)
        finally:
            sock.close(0)
            if self.endpoint.startswith("ipc://"):
                try:
                    os.unlink(self.endpoint[len("ipc://"):])
                except OSError:
                    pass

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
