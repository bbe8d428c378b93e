"""Bearer API key: 401 without one, 403 with a wrong one; trace endpoints are off without a configured key."""

from __future__ import annotations

import hmac

from fastapi.security import HTTPAuthorizationCredentials

from sparseety.serve.errors import APIError


def check_key(expected: str | None, credentials: HTTPAuthorizationCredentials | None) -> None:
    """Pass when no key is configured or the bearer token equals it (compared in constant time)."""
    if expected is None:
        return
    if credentials is None or not credentials.credentials:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise APIError(403, "the API key is not valid for this server", code="invalid_api_key")


def check_trace_access(expected: str | None, tracing: bool, credentials: HTTPAuthorizationCredentials | None) -> None:
    """Trace endpoints: 404 without a configured key, then the key check, then 404 when tracing is off."""
    if expected is None:
        raise APIError(404, "trace endpoints are off: start the server with --api-key to enable them",
                       code="not_found")
    check_key(expected, credentials)
    if not tracing:
        raise APIError(404, "tracing is off: start the server with --trace-dir", code="not_found")
