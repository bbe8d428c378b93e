"""The engine core's end of the scheduler channel: one ZMQ PUSH socket per API server, never blocking (a full queue
drops and counts). No vLLM, no torch; msgspec and pyzmq are imported when the first message goes out."""

from __future__ import annotations

from typing import Any

from sparseety.integrations.vllm.transport.channels import client_channel


class ChannelSender:
    """The engine core's end of the channel: PUSH, never blocking (a full queue drops and counts)."""

    def __init__(self) -> None:
        import msgspec
        import zmq

        self._zmq = zmq
        self._sockets: dict[int, Any] = {}  #: API server (client index) -> PUSH to its channel
        self._encode = msgspec.msgpack.Encoder().encode
        self.dropped = 0

    def _socket(self, client: int) -> Any:
        sock = self._sockets.get(client)
        if sock is None:
            zmq = self._zmq
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(client_channel(client))
            self._sockets[client] = sock
        return sock

    def send(self, kind: str, records: list[list], client: int = 0) -> None:
        try:
            self._socket(client).send(self._encode([kind, records]), self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += len(records)
