"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


class APIError(Exception):
    """A client-facing error answered with ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON response holding :func:`error_body`."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "sparsity", "budget")`` -> ``"sparsity.budget"``; None for the body as a whole."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # Union members appear in the location as type names ("str", "list[...]"); they say nothing to a caller.
    parts = [p for p in parts if not (p[:1].islower() and ("[" in p or p in {"str", "int", "float", "bool"}))]
    return ".".join(parts) or None


TOKEN_COUNT_FIELDS = ("max_tokens", "max_completion_tokens")


def _describe_validation(exc: RequestValidationError, max_tokens_limit: int | None,
                         content_type: str | None = None) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    param = _validation_param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if tuple(first.get("loc", ())) == ("body",):  # the body as a whole was not read as a JSON object
        sent = "no Content-Type header" if content_type is None else f"Content-Type {content_type!r}"
        return (f"the request body must be one JSON object sent with Content-Type: application/json; this request "
                f"has {sent}"), None
    if param in TOKEN_COUNT_FIELDS and max_tokens_limit is not None:  # 1e20, "5", true: say the server's range
        return f"{param} must be an integer between 1 and {max_tokens_limit}, got {first.get('input')!r}", param
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors with 400, HTTP errors and :class:`APIError` in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        state = getattr(request.app.state, "serve", None)
        message, param = _describe_validation(exc, state.config.max_tokens_limit if state is not None else None,
                                              request.headers.get("content-type"))
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, dict(exc.headers or {}) or None)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:  # a server bug, never a client's fault
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")
