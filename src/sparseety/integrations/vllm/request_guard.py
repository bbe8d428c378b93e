"""The API server's check of each request's ``sparseety_*`` args: a bad one gets HTTP 400 before the request
reaches the engine (:func:`.request_args.check_request_args`).

Two hooks, both in the API-server process:

- ``request-args``: around ``InputProcessor._validate_params`` (where vLLM validates every request's sampling
  params, over HTTP or from Python): a bad arg raises vLLM's own ``VLLMValidationError`` naming it, which vLLM
  answers with HTTP 400 (``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``).
- ``request-args-json``: vLLM's schema reads ``vllm_xargs`` values as ``str | int | float``, so JSON ``true``
  arrives as ``1``. An ASGI middleware, innermost (after vLLM's authentication), reads the raw JSON body of a
  POST that mentions ``sparseety_`` and runs the same check on the values as sent, so ``"sparseety_budget":
  true`` is refused instead of served as budget 1. Other bodies pass through untouched.

A failure inside either check is logged once and the request goes on (:func:`.hooks.guarded`): the engine core
still checks what it runs (served dense, counted and recorded).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sparseety.integrations.vllm.vllm_api import adapter
from sparseety.integrations.vllm.evict.settings import EvictionSettings
from sparseety.integrations.vllm.vllm_api.guards import guarded
from sparseety.integrations.vllm.request_args import PREFIX, check_request_args
from sparseety.integrations.vllm.transport.values import BadValue

log = logging.getLogger("sparseety.vllm")
HOOK, HOOK_JSON = "request-args", "request-args-json"
_MARKER = PREFIX.encode()


class _Guard:
    """The server's eviction settings and the check of one request's args."""

    def __init__(self, eviction: EvictionSettings | None) -> None:
        self.eviction = eviction

    def problem(self, extra: Any) -> BadValue | None:
        try:
            check_request_args(extra if isinstance(extra, dict) else None, self.eviction)
        except BadValue as bad:
            return bad
        return None

    def problem_in_body(self, body: bytes) -> BadValue | None:
        """The bad arg in a raw JSON body's ``vllm_xargs`` (None: none, or not JSON, which vLLM answers itself)."""
        try:
            request = json.loads(body)
        except ValueError:
            return None
        extra = request.get("vllm_xargs") if isinstance(request, dict) else None
        return self.problem(extra) if isinstance(extra, dict) else None


def install(loud: bool, eviction: EvictionSettings | None) -> None:
    """Install both hooks; ``eviction``: what this server evicts (None: nothing, so eviction args are refused)."""
    guard = _Guard(eviction)
    on = adapter.check((HOOK, HOOK_JSON), loud=loud)
    if on[HOOK]:
        _patch_validate(guard)
    if on[HOOK_JSON]:
        _patch_middleware(guard)


def _patch_validate(guard: _Guard) -> None:
    error = adapter.validation_error()

    def make(original):
        def _validate_params(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)
            bad = guarded(HOOK, guard.problem, adapter.sampling_extra_args(params))
            if bad is not None:
                raise error(str(bad), parameter=bad.name)
            return result
        return _validate_params

    adapter.patch(adapter.resolve(adapter.INPUT), "_validate_params", HOOK, make)


def _patch_middleware(guard: _Guard) -> None:
    def make(original):
        def init_entrypoints_middleware(args, app, *rest, **kwargs):
            result = original(args, app, *rest, **kwargs)
            guarded(HOOK_JSON, adapter.add_inner_middleware, app, _RawArgsCheck, guard)
            return result
        return init_entrypoints_middleware

    adapter.patch(adapter.resolve(adapter.APP), "init_entrypoints_middleware", HOOK_JSON, make)


class _RawArgsCheck:
    """ASGI middleware: HTTP 400 for a POST whose raw ``vllm_xargs`` hold a bad ``sparseety_*`` arg."""

    def __init__(self, app: Any, guard: _Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        first: list[dict] = []
        body = b""
        while True:
            message = await receive()
            first.append(message)
            if message.get("type") != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        bad = guarded(HOOK_JSON, self.guard.problem_in_body, body) if _MARKER in body else None
        if bad is not None:
            await _reject(send, bad)
            return
        sent = any(m.get("type") == "http.request" for m in first)
        replay = [{"type": "http.request", "body": body, "more_body": False}] if sent else []
        replay += [m for m in first if m.get("type") != "http.request"]  # a disconnect, as it came

        async def receive_again() -> dict:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, receive_again, send)


async def _reject(send: Any, bad: BadValue) -> None:
    payload = json.dumps({"error": {"message": str(bad), "type": "BadRequestError", "param": bad.name,
                                    "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
