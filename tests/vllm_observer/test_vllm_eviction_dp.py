"""Eviction inside ``vllm serve --data-parallel-size 2`` (``SPARSEETY_KV_POLICY=dense``, requests choose with
``vllm_xargs``): requests spread over both engine cores give the own engine's tokens for their policy, each
engine core's eviction record reaches the trace with its rank, and a request asking for dense is served dense with
nothing refused. A module of its own so
that its two engine cores start after the other eviction servers have stopped."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_server import VllmServer, require_vllm

pytestmark = pytest.mark.model

BUDGET = 64
NEW_TOKENS = 24
LICENSES = Path("/usr/share/common-licenses")
#: (policy, prompt) of each request; the last asks for dense (a policy vLLM cannot run gets HTTP 400:
#: test_vllm_request_args.py)
ASKED = [(policy, (LICENSES / name).read_text()[start:start + 650]) for policy, (name, start) in zip(
    ("streaming", "tova", "snapkv", "kvzap", "streaming", "tova", "dense"),
    (("GPL-3", 11000), ("Apache-2.0", 2000), ("MPL-2.0", 9000), ("LGPL-3", 3000), ("GPL-2", 8000),
     ("Artistic", 1000), ("GPL-3", 15000)))]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Each request's response and stored record: the requests sent four at a time, until both ranks served."""
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("eviction-dp")
    env = {"SPARSEETY_KV_POLICY": "dense", "SPARSEETY_KV_INTERVAL": "1", "SPARSEETY_TIER": "2",
           "SPARSEETY_SAMPLE_RATE": "1", "SPARSEETY_IMPORTANCE": "off"}
    server = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log", extra_env=env,
                        speculative=False, extra_args=["--data-parallel-size", "2"]).start()
    try:
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda pt: server.complete(pt[1], NEW_TOKENS, ignore_eos=True, vllm_xargs={
                "sparseety_policy": pt[0], **({} if pt[0] == "dense" else {"sparseety_budget": BUDGET})}), ASKED))
        ids = [r["id"] + "-0" for r in responses]
        rows = server.stored(ids)
        yield {"responses": responses, "records": [json.loads(rows[i][0])["vllm"] for i in ids],
               "metrics": server.metrics(), "log": server.log_tail(3000)}
    finally:
        server.stop()


def test_both_engine_cores_evict_and_record(served):
    ranks = {r["data_parallel_rank"] for r in served["records"][:-1]}
    assert ranks == {0, 1}, served["log"]
    for (policy, _), record in zip(ASKED[:-1], served["records"][:-1]):
        eviction = record["eviction"]
        assert eviction["policy"] == policy and eviction["failure"] is None
        assert eviction["compactions"] == NEW_TOKENS - 1 and eviction["evicted_tokens_per_layer"] > 0


def test_every_request_gives_the_own_engines_tokens(served):
    import sparseety

    model = sparseety.load("smollm2-135m")
    for (policy, text), out in zip(ASKED, served["responses"]):
        own = model.generate(text, max_new_tokens=NEW_TOKENS, chat=False,
                             **({"policy": "dense"} if policy == "dense" else {
                                 "policy": policy, "budget": BUDGET,
                                 "policy_opts": {"per_head": False} if policy == "kvzap" else {}}))
        assert out["choices"][0]["token_ids"] == list(own.output_ids), policy


def test_nothing_was_refused_or_failed(served):
    assert served["records"][-1].get("eviction") is None  # the dense request
    assert served["metrics"].get("sparseety:eviction_refused_total", 0.0) == 0.0
    assert served["metrics"].get("sparseety:eviction_failures_total", 0.0) == 0.0
