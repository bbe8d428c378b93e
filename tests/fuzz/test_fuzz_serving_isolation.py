"""The serving fuzzer: mixed valid and invalid requests sent at once to a real server on loopback.

Every valid request must get exactly the answer it gets alone, and no invalid one may change another's
outcome. The invalid kinds cover each place a request can fail: the body (bad fields, roles, types),
building its policy (unknown names, bad options), binding it to the model (``learned`` without a
predictor file, refused before it joins the batch), and its policy failing inside a step (a policy
registered for this test whose ``score`` raises at a chosen decode step, mid-batch).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import httpx2 as httpx
import pytest
from fuzz_helpers import examples
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from tiny_models import build_model, build_tokenizer

from sparseety.engine import SparseEngine
from sparseety.policies import registry
from sparseety.policies.base import Observation
from sparseety.policies.h2o import H2OPolicy

MODEL = "tiny-llama"
WORDS = st.lists(st.sampled_from([f"t{i}" for i in range(4, 40)]), min_size=1, max_size=24).map(" ".join)
VALID_SPARSITY = st.one_of(
    st.none(),
    st.builds(lambda p, b: {"policy": p, "budget": b},
              st.sampled_from(["dense", "streaming", "h2o", "snapkv", "tova", "pyramid", "knorm", "keydiff", "kvzip"]),
              st.integers(8, 24)),
    st.builds(lambda r: {"policy": "tova", "ratio": r}, st.sampled_from([0.25, 0.5])),
)
INVALID_SPARSITY = st.sampled_from([
    {"policy": "learned", "budget": 16},  # no predictor file: refused when it is added, alone
    {"policy": "faulty", "budget": 12},  # raises inside a packed decode step
    {"policy": "faulty", "budget": 12, "options": {"fail_step": "0"}},  # raises at its prefill
    {"policy": "nope", "budget": 8},
    {"policy": "h2o", "budget": 8, "options": {"sinks": -1}},
    {"policy": "h2o", "budget": 8, "ratio": 0.5},
    {"policy": "tova", "ratio": float("nan")},
    {"policy": "streaming", "budget": 0},
])


@dataclass
class FaultyPolicy(H2OPolicy):
    """``h2o`` whose ``score`` raises from output step ``fail_step`` on: a policy bug inside a batch step."""

    name: ClassVar[str] = "faulty"
    summary: ClassVar[str] = "test only: raises while scoring"
    fail_step: int = 2

    def score(self, obs: Observation):
        if obs.step >= self.fail_step:
            raise RuntimeError(f"faulty policy raised at step {obs.step}")
        return super().score(obs)


@pytest.fixture(scope="module")
def server():
    from serve_helpers import LiveServer

    from sparseety.serve import ServeConfig, create_app

    registry._POLICIES["faulty"] = FaultyPolicy
    engine = SparseEngine(build_model("llama"), build_tokenizer(), model_name=MODEL)
    config = ServeConfig(model=MODEL, max_concurrency=4, max_queue=64, max_tokens_limit=6, prefill_chunk=16)
    live = LiveServer(create_app(config, engine)).start()
    try:
        yield live
    finally:
        live.stop()
        registry._POLICIES.pop("faulty", None)


def body(prompt: str, sparsity: dict | None, max_tokens: int, chat: bool = False) -> tuple[str, dict]:
    payload: dict = {"model": MODEL, "max_tokens": max_tokens}
    if chat:
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    if sparsity is not None:
        payload["sparsity"] = sparsity
    return ("/v1/chat/completions" if chat else "/v1/completions"), payload


def answer(response: httpx.Response) -> str:
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# The tiny tokenizer has no chat template: generation goes through /v1/completions (chat bodies are refused by their schema)
VALID = st.builds(lambda p, s, m: ("valid", body(p, s, m, False)), WORDS, VALID_SPARSITY, st.integers(1, 6))
INVALID = st.one_of(
    st.builds(lambda p, s: ("invalid", body(p, s, 5, False)), WORDS, INVALID_SPARSITY),
    st.builds(lambda p: ("invalid", ("/v1/chat/completions", {"model": MODEL, "max_tokens": 3,
                                                              "messages": [{"role": "wizard", "content": p}]})), WORDS),
    st.builds(lambda p: ("invalid", ("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 10**20})), WORDS),
    st.just(("invalid", ("/v1/completions", {"model": MODEL, "prompt": ""}))),
)


# The issue's run: innocent requests of many policies beside one without its predictor file and two whose policy raises
ISSUE_MIX = [("valid", body("t5 t9 t13 t7 t22 t30 t31", {"policy": p, "budget": 10}, 6))
             for p in ("tova", "kvzip", "pyramid", "keydiff", "h2o", "snapkv", "streaming", "dense", "knorm")]
ISSUE_MIX[2:2] = [("invalid", body("t8 t9 t10 t11", {"policy": "learned", "budget": 16}, 5))]
ISSUE_MIX[5:5] = [("invalid", body("t8 t9 t10 t11 t12 t14", {"policy": "faulty", "budget": 4}, 6))]
ISSUE_MIX[8:8] = [("invalid", body("t20 t21 t22", {"policy": "faulty", "budget": 4, "options": {"fail_step": "0"}}, 6))]


@settings(examples(6), phases=(Phase.explicit, Phase.generate))  # no shrinking: each example is a live burst
@given(requests=st.lists(st.one_of(VALID, VALID, INVALID), min_size=6, max_size=12))
@example(requests=ISSUE_MIX)
def test_invalid_requests_never_change_a_valid_requests_answer(server, requests):
    alone: dict[int, str] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for i, (kind, (path, payload)) in enumerate(requests):  # each valid request alone first
            if kind == "valid":
                response = client.post(path, json=payload)
                assert response.status_code == 200, response.text
                alone[i] = answer(response)

        def send(item):
            _, (path, payload) = item
            return client.post(path, content=json.dumps(payload, allow_nan=True),
                               headers={"Content-Type": "application/json"})

        with ThreadPoolExecutor(max_workers=len(requests)) as pool:  # then all of them at once
            responses = list(pool.map(send, requests))
    for i, ((kind, (path, payload)), response) in enumerate(zip(requests, responses)):
        if kind == "valid":
            assert response.status_code == 200, (payload, response.text)
            assert answer(response) == alone[i], payload
        else:
            assert response.status_code != 200, (payload, response.text)
            error = response.json()["error"]
            assert error["message"], payload
            if payload.get("sparsity", {}).get("policy") == "faulty":
                assert response.status_code == 500 and "internal error" in error["message"], error
            else:
                assert 400 <= response.status_code < 500, (payload, response.text)
    state = server.state
    assert state.loop.running == 0 and state.loop.batch.reserved_bytes == 0  # every slot and reservation freed
