"""ASGI middleware refusing request bodies over a size limit with 413 (declared or streamed bytes)."""

from __future__ import annotations

from typing import Any

from sparseety.serve.errors import error_response

Scope = dict[str, Any]


class BodySizeLimit:
    """Read the whole body (at most ``max_bytes``) before the app sees it; larger bodies get 413.

    A ``Content-Length`` over the limit is refused before any body byte is read; a body sent without
    one (chunked) is counted as it streams in.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await error_response(400, "Content-Length is not a number", None, "invalid_value")(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Any, send: Any) -> None:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        await error_response(413, message, None, "request_too_large")(scope, receive, send)
