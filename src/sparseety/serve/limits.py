"""ASGI middleware refusing request bodies over a size limit with 413 (declared or streamed bytes),
and POST bodies that are not one JSON object sent as ``application/json`` with 400."""

from __future__ import annotations

import json
from email.message import Message
from typing import Any

from sparseety.errors import InputError
from sparseety.request_json import parse_json_object
from sparseety.serve.errors import error_response

Scope = dict[str, Any]


class BodySizeLimit:
    """Read the whole body (at most ``max_bytes``) before the app sees it; larger bodies get 413.

    A ``Content-Length`` over the limit is refused before any body byte is read; a body sent without
    one (chunked) is counted as it streams in. A POST body must then be one JSON object
    (:func:`json_body_problem`).
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
        problem = json_body_problem(scope, b"".join(chunks)) if scope.get("method") == "POST" else None
        if problem is not None:
            await error_response(400, problem, None, "invalid_value")(scope, receive, send)
            return
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


def json_body_problem(scope: Scope, body: bytes) -> str | None:
    """Why ``body`` is not one JSON object sent as JSON (a key given twice included); None when it is.

    No ``Content-Type`` at all is read as JSON, as FastAPI does.
    """
    declared = dict(scope.get("headers") or ()).get(b"content-type")
    if declared is not None:
        kind = declared.decode("latin-1")
        parsed = Message()
        parsed["content-type"] = kind
        subtype = parsed.get_content_subtype()
        if parsed.get_content_maintype() != "application" or not (subtype == "json" or subtype.endswith("+json")):
            return f"the request body must be JSON sent with Content-Type: application/json, got {kind.strip()!r}"
    try:
        parse_json_object(body.decode(json.detect_encoding(body)), what="the request body")
    except UnicodeDecodeError as exc:
        return f"the request body is not UTF-8 text: {exc.reason} at byte {exc.start}"
    except InputError as exc:
        return str(exc)
    return None
