"""schemathesis against the app's own OpenAPI schema, on a loopback server with the real model: no 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from serve_helpers import MODEL, live_server

KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzzed_server(engine, tmp_path_factory):
    # Tiny generations and bodies keep every example cheap; a key makes the trace endpoints reachable.
    with live_server(engine, api_key=KEY, trace_dir=tmp_path_factory.mktemp("fuzz"), sample_rate=0.5,
                     max_tokens_limit=2, max_body_bytes=1024, max_concurrency=2, max_queue=64) as srv:
        yield srv


OPERATIONS = ["GET /health", "GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions",
              "GET /v1/traces", "GET /v1/traces/{request_id}"]


@pytest.fixture(scope="module")
def operations(fuzzed_server):
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    found = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        found[f"{operation.method.upper()} {operation.path}"] = operation
    assert sorted(found) == sorted(OPERATIONS)
    return found


@pytest.mark.parametrize("name", OPERATIONS)
def test_no_server_errors(operations, name):
    @given(case=operations[name].as_strategy())
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case):
        # Generated keys would only ever meet 401/403 (tested on their own): send the server's key.
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
        if isinstance(case.body, dict):  # a random model name only ever meets 404: name the served one
            case.body["model"] = MODEL
        case.call_and_validate(checks=[not_a_server_error], timeout=120)

    check()
