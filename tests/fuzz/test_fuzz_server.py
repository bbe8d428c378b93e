"""Fuzzed server bodies: any JSON (or not JSON) sent to the generation and trace endpoints gets an
answer below 500, an error is an OpenAI-style error object, and every traced request the server
accepted can be read back from its store."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest
from fuzz_helpers import examples
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import build_model, build_tokenizer

from sparseety.engine import SparseEngine

KEY = "fuzz-key"
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=12))
ANY = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                   max_leaves=8)
WORDS = st.lists(st.sampled_from([f"t{i}" for i in range(4, 40)]), min_size=1, max_size=12).map(" ".join)
SPARSITY = st.fixed_dictionaries({}, optional={
    "policy": st.one_of(st.sampled_from(["h2o", "streaming", "snapkv", "dense", "nope", ""]), SCALARS),
    "budget": st.one_of(st.integers(min_value=-5, max_value=2**70), SCALARS),
    "ratio": st.one_of(st.floats(min_value=-1, max_value=2), SCALARS),
    "tier": st.one_of(st.integers(-1, 5), SCALARS), "trace": st.one_of(st.booleans(), SCALARS),
    "options": st.one_of(st.dictionaries(st.sampled_from(["recent_ratio", "sinks", "x"]), SCALARS), SCALARS)})
COMMON = {"model": st.one_of(st.just("tiny-llama"), SCALARS),
          "max_tokens": st.one_of(st.integers(min_value=-3, max_value=2**70), SCALARS),
          "temperature": st.one_of(st.floats(min_value=-1, max_value=3), SCALARS),
          "top_p": st.one_of(st.floats(min_value=-1, max_value=2), SCALARS),
          "seed": st.one_of(st.integers(min_value=-(2**64), max_value=2**65), SCALARS),
          "n": st.one_of(st.integers(-1, 3), SCALARS), "stream": st.one_of(st.booleans(), SCALARS),
          "sparsity": st.one_of(SPARSITY, ANY), "unknown": ANY}
CHAT = st.fixed_dictionaries({"messages": st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                    "content": st.one_of(WORDS, SCALARS)}), max_size=3), ANY)},
    optional=COMMON)
COMPLETION = st.fixed_dictionaries({"prompt": st.one_of(WORDS, st.lists(WORDS, max_size=2), SCALARS)},
                                   optional=COMMON)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from sparseety.serve import ServeConfig, create_app

    trace_dir = tmp_path_factory.mktemp("fuzz-serve")
    engine = SparseEngine(build_model("llama"), build_tokenizer(), model_name="tiny-llama")
    config = ServeConfig(model="tiny-llama", trace_dir=str(trace_dir), api_key=KEY, max_tokens_limit=4,
                         sample_rate=1.0)
    with TestClient(create_app(config, engine)) as test_client:
        test_client.trace_dir = Path(trace_dir)
        yield test_client


def check_answer(response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body.get("error"), dict) and body["error"].get("message"), body


@examples(60)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), chat=CHAT, completion=COMPLETION,
       raw=st.one_of(st.none(), st.binary(max_size=40), st.text(max_size=40)))
def test_generation_bodies_never_get_a_5xx(client, path, chat, completion, raw):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if raw is not None:
        response = client.post(path, content=raw if isinstance(raw, bytes) else raw.encode(), headers=headers)
    else:
        body = chat if path.endswith("chat/completions") else completion
        response = client.post(path, content=json.dumps(body), headers=headers)
    check_answer(response)


@examples(30)
@given(request_id=st.text(max_size=80), limit=st.one_of(st.integers(-5, 2**40).map(str), st.text(max_size=8)))
def test_trace_endpoints_never_get_a_5xx(client, request_id, limit):
    headers = {"Authorization": f"Bearer {KEY}"}
    check_answer(client.get("/v1/traces", params={"limit": limit}, headers=headers))
    check_answer(client.get(f"/v1/traces/{quote(request_id, safe='')}", headers=headers))


def test_accepted_traced_requests_are_all_stored(client):
    from sparseety.store import list_traces

    ids = []
    for i in range(3):
        rid = f"fuzz-kept-{i}"
        response = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "t5 t6 t7", "max_tokens": 2},
                               headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": rid,
                                        "X-Sparseety-Trace": "1"})
        assert response.status_code == 200, response.text
        ids.append(rid)
    state = client.app.state.serve
    state.tracer.writer.flush(timeout=30)
    stored = {row["request_id"] for row in list_traces(client.trace_dir, limit=1000)}
    assert set(ids) <= stored
