"""The server batches: concurrent clients are decoded together, get the answers they get alone, and are
admitted by reserved KV bytes (a real server on loopback, the real ``openai`` client, parsed ``/metrics``)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
from serve_helpers import MODEL, live_server, scrape

from sparseety.engine import encode_messages
from sparseety.policies import build_policy

QUESTIONS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Give me a color.", "Name a planet.",
             "What is the capital of Italy?", "Count to three.", "Name an animal."]
SPARSITY = [None, {"policy": "streaming", "budget": 24}, {"policy": "h2o", "budget": 32}, None]


def _ask(client: openai.OpenAI, i: int) -> tuple[str, dict]:
    extra = {} if SPARSITY[i % 4] is None else {"sparsity": SPARSITY[i % 4]}
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[i]}],
                                           max_tokens=12, extra_body=extra)
    return reply.choices[0].message.content, reply.usage.model_dump()


def test_concurrent_clients_are_decoded_together_and_answered_as_if_alone(engine):
    with live_server(engine, max_concurrency=8, prefill_chunk=16) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
        alone = [_ask(client, i) for i in range(len(QUESTIONS))]  # one at a time: batches of one
        before = scrape(srv.url)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            together = list(pool.map(lambda i: _ask(client, i), range(len(QUESTIONS))))
        after = scrape(srv.url)
    assert together == alone  # text and usage (token counts, evictions, KV bytes) alike
    assert any(u["sparsity"]["eviction_events"] for _, u in together)
    steps = after["sparseety:batch_size_count{}"] - before["sparseety:batch_size_count{}"]
    sequences = after["sparseety:batch_size_sum{}"] - before["sparseety:batch_size_sum{}"]
    assert sequences / steps > 1.5  # steps really carried several sequences at once
    assert after["sparseety:kv_cache_reserved_bytes{}"] == 0 and after["sparseety:num_requests_running{}"] == 0


def test_a_memory_limit_admits_by_reserved_kv_bytes(engine):
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    encoded = encode_messages(tokenizer, messages)
    dense = engine.reserved_kv_bytes(encoded, build_policy("dense"), 8)
    sparse = engine.reserved_kv_bytes(encoded, build_policy("streaming", 8), 8)
    assert sparse < dense
    limit = dense + sparse  # one dense request and one sparse one fit together; two dense never do
    with live_server(engine, max_concurrency=8, kv_memory_limit=limit) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
        bodies = [{} if i % 2 == 0 else {"sparsity": {"policy": "streaming", "budget": 8}} for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda extra: client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, extra_body=extra), bodies))
        assert all(r.usage.completion_tokens >= 1 for r in replies)
        metrics = scrape(srv.url)
        assert metrics["sparseety:kv_cache_reserved_bytes{}"] == 0
        assert 0 < srv.state.loop.batch.scheduler.peak_reserved_bytes <= limit
        too_big = httpx.post(f"{srv.url}/v1/completions", timeout=60, content=json.dumps(
            {"model": MODEL, "prompt": "word " * 600, "max_tokens": 200}).encode(),
            headers={"Content-Type": "application/json"})
    assert too_big.status_code == 400
    error = too_big.json()["error"]
    assert error["code"] == "kv_memory_limit_exceeded" and error["param"] == "max_tokens"
    assert str(limit) in error["message"] and "--kv-memory-limit" in error["message"]
