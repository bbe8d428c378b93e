"""The request-arg and setting checks that need no vLLM: strict numbers, unknown keys and variables, and the raw-JSON
middleware run on a small ASGI app (the live 400s are in test_vllm_request_args.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from sparseety.integrations.vllm.transport.env_names import unknown_variables
from sparseety.integrations.vllm.evict.settings import parse_eviction
from sparseety.integrations.vllm.request_args import check_request_args
from sparseety.integrations.vllm.request_guard import _Guard, _RawArgsCheck
from sparseety.integrations.vllm.transport.values import BadValue, decimal_int, decimal_number, shown

DENSE = parse_eviction({"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_BUDGET": "64"})


@pytest.mark.parametrize("raw, value", [(64, 64), ("64", 64), (" 64 ", 64), (64.0, 64), (10**9, 10**9)])
def test_decimal_int_reads_numbers_and_ascii_digits(raw, value):
    assert decimal_int(raw, "x") == value


@pytest.mark.parametrize("raw", [True, False, 0, -1, 10**9 + 1, 10**400, 1e400, float("nan"), 1.5, "\u0666\u0664", "6_4",
                                 "+64", "0x40", "", "1e3", None, [64], "9" * 30])
def test_decimal_int_refuses_what_is_not_a_plain_integer(raw):
    with pytest.raises(BadValue) as info:
        decimal_int(raw, "x")
    assert info.value.name == "x" and str(info.value).startswith(f"x={shown(raw)} is not an integer in [1, ")


@pytest.mark.parametrize("raw", [True, 1.0, -0.1, float("inf"), float("nan"), "1e400", "\u0660.5", "0.5.1", 10**400])
def test_decimal_number_refuses_what_is_not_a_finite_number_in_range(raw):
    with pytest.raises(BadValue, match=r"is not a number in \[0, 1\)"):
        decimal_number(raw, "r", 0.0, 1.0, high_open=True)
    assert decimal_number("0.25", "r", 0.0, 1.0, high_open=True) == 0.25


def test_shown_cuts_long_values_and_says_how_long():
    assert shown("abc") == "'abc'"
    text = shown("y" * 100_000)
    assert len(text) < 120 and text.endswith("... (100000 chars)")


@pytest.mark.parametrize("extra, arg, words", [
    ({"sparseety_polcy": "tova"}, "sparseety_polcy", "did you mean sparseety_policy?"),
    ({"sparseety_" + "z" * 5000: 1}, "sparseety_" + "z" * 70 + "... (5010 chars)", "(5010 chars) is not a SparSEEty"),
    ({"sparseety_tier": 2}, "sparseety_tier", "is not 3"),
    ({"sparseety_tier": True}, "sparseety_tier", "=True is not 3"),
    ({"sparseety_importance": 3}, "sparseety_importance", "=3 is not one of value, attention, output, off"),
    ({"sparseety_policy": "tova", "sparseety_budget": True}, "sparseety_budget", "=True is not an integer"),
])
def test_a_bad_request_arg_is_named(extra, arg, words):
    with pytest.raises(BadValue) as info:
        check_request_args(extra, DENSE)
    assert info.value.name == arg and words in str(info.value) and len(str(info.value)) < 700


def test_good_args_and_other_plugins_keys_pass():
    for extra in (None, {}, {"sparseety_tier": 3}, {"sparseety_tier": "3"}, {"sparseety_importance": "off"},
                  {"sparseety_policy": "tova"}, {"sparseety_policy": "snapkv", "sparseety_ratio": "0.5"},
                  {"session_id": "s1", "other_plugin": True}):
        check_request_args(extra, DENSE)


def test_a_server_that_does_not_evict_refuses_eviction_args_but_not_dense():
    check_request_args({"sparseety_policy": "dense", "sparseety_tier": 3}, None)
    for extra in ({"sparseety_policy": "tova", "sparseety_budget": 8}, {"sparseety_budget": 8},
                  {"sparseety_policy_opts": "sinks=4"}):
        with pytest.raises(BadValue, match="this vLLM server does not evict"):
            check_request_args(extra, None)


def test_unknown_variables_warn_once_each_with_the_closest_name():
    env = {"SPARSEETY_KV_POLCY": "tova", "SPARSEETY_TRACE_DIR": "/tmp/t", "SPARSEETY_TEST_ANYTHING": "1",
           "SPARSEETY_ZZZZZZZZZZZZZZ": "1", "PATH": "/bin"}
    assert unknown_variables(env) == [
        "sparseety: SPARSEETY_KV_POLCY is not a SparSEEty setting and is ignored; did you mean SPARSEETY_KV_POLICY?",
        "sparseety: SPARSEETY_ZZZZZZZZZZZZZZ is not a SparSEEty setting and is ignored"]


# -- the raw-JSON middleware ----------------------------------------------------------------------------------
def _serve(body: bytes, chunks: int = 1) -> tuple[list[dict], list[bytes]]:
    """Run ``body`` (in ``chunks`` parts) through the middleware; what it sent and what the app read."""
    sent: list[dict] = []
    seen: list[bytes] = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    size = max(1, -(-len(body) // chunks))
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    middleware = _RawArgsCheck(app, _Guard(DENSE))
    asyncio.run(middleware({"type": "http", "method": "POST"}, receive, send))
    return sent, seen


def test_the_middleware_refuses_true_as_a_budget_with_vllms_error_shape():
    body = b'{"prompt": "hi", "vllm_xargs": {"sparseety_policy": "tova", "sparseety_budget": true}}'
    sent, seen = _serve(body, chunks=3)
    assert seen == [] and sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error == {"message": "sparseety_budget=True is not an integer in [1, 1000000000]", "type": "BadRequestError",
                     "param": "sparseety_budget", "code": 400}


@pytest.mark.parametrize("body", [
    b'{"prompt": "hi", "vllm_xargs": {"sparseety_policy": "tova", "sparseety_budget": 32}}',
    b'{"prompt": "no args of ours"}',
    b'not json, says sparseety_ but vLLM answers it',
    b'',
])
def test_the_middleware_passes_other_bodies_whole(body):
    sent, seen = _serve(body, chunks=4)
    assert seen == [body] and sent[0]["status"] == 200
