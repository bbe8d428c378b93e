"""The real ``openai`` client against a real server on loopback (default model): answers, usage, metrics, errors."""

from __future__ import annotations

import contextlib

import json
import time

import httpx2 as httpx
import openai
import pytest
from serve_helpers import MODEL, live_server, scrape

from sparseety.engine import encode_prompt
from sparseety.policies import build_policy, resolve_budget
from sparseety.store import load_trace

KEY = "test-key"
BUDGET = 20
CHAT = [{"role": "user", "content": "List three colors, one per line."}]
PROMPT = "Count with me: one, two, three, four,"


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    with live_server(engine, api_key=KEY, policy="streaming", budget=BUDGET, trace_dir=tmp_path_factory.mktemp("t"),
                     sample_rate=0.0, max_concurrency=1, max_queue=2, max_tokens_limit=32,
                     max_body_bytes=64 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path, body=None, *, key=KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kwargs.pop("headers", {}))
    if body is not None:  # json.dumps escapes lone surrogates, which a client may send
        kwargs["content"] = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    return httpx.post(f"{server.url}{path}", headers=headers, timeout=120, **kwargs)


def direct(engine, text, chat, policy, max_tokens):
    """The same generation straight on the engine: what the server must report."""
    return engine.generate(encode_prompt(engine.tokenizer, text, chat), policy, max_new_tokens=max_tokens, tier=1)


def sparsity_of(result) -> dict:
    return {"policy": result.policy, "evicted_positions": result.evicted_positions,
            "eviction_events": result.eviction_events, "kv_cache_bytes_peak": result.kv_cache_bytes_peak,
            "kv_cache_bytes_dense": result.kv_cache_bytes_dense, "draft_rejected": result.draft_rejected,
            "pruned_tokens": result.pruned_tokens}


def test_chat_completion_matches_the_engine_with_the_server_policy(client, engine):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0.7)
    expected = direct(engine, CHAT[0]["content"], True, build_policy("streaming", BUDGET), 6)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"
    usage = reply.usage.model_dump()
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(expected.prompt_ids), 6)
    assert usage["total_tokens"] == len(expected.prompt_ids) + 6
    assert usage["sparsity"] == sparsity_of(expected)
    assert usage["sparsity"]["evicted_positions"] > 0  # the prompt is longer than the budget


def test_completion_with_a_policy_override_in_the_body(client, engine):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                      extra_body={"sparsity": {"policy": "h2o", "budget": 8}})
    expected = direct(engine, PROMPT, False, build_policy("h2o", 8), 4)
    assert reply.choices[0].text == expected.text
    assert reply.usage.model_dump()["sparsity"] == sparsity_of(expected)
    assert reply.usage.model_dump()["sparsity"]["policy"] == "h2o"


def test_ratio_in_the_body_resolves_against_the_prompt_length(client, engine):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                      extra_body={"sparsity": {"policy": "streaming", "ratio": 0.5}})
    prompt_len = reply.usage.prompt_tokens
    expected = direct(engine, PROMPT, False, build_policy("streaming", resolve_budget(None, 0.5, prompt_len)), 3)
    assert reply.choices[0].text == expected.text
    assert reply.usage.model_dump()["sparsity"] == sparsity_of(expected)
    assert expected.evicted_positions > 0


def test_streamed_chat_joins_to_the_plain_answer_and_ends_with_usage(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_streamed_completion_without_usage(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_client_leaving_a_stream_stops_its_generation(server):
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]
    deadline = time.monotonic() + 120  # a hang guard: the request must leave the batch
    while server.state.loop.running and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(server.url)
    assert after.get("sparseety:request_aborted_total{reason=client_disconnected}", 0) - before.get(
        "sparseety:request_aborted_total{reason=client_disconnected}", 0) == 1
    assert after["sparseety:generation_tokens_total{}"] == before["sparseety:generation_tokens_total{}"]
    assert server.state.loop.waiting == 0 and server.state.loop.running == 0


def test_audit_usage_agrees_with_the_servers_prompt_counts(server, tmp_path):
    """``sparseety audit-usage`` recounts prompts with the model's own tokenizer and chat template."""
    from typer.testing import CliRunner

    from sparseety.cli import app

    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(body) for body in (
        {"messages": CHAT, "max_tokens": 2},
        {"messages": [{"role": "system", "content": "Be brief."}, *CHAT], "max_tokens": 2},
        {"prompt": PROMPT, "max_tokens": 2},
    )) + "\n")
    result = CliRunner().invoke(app, ["audit-usage", "--base-url", f"{server.url}/v1", "--model", MODEL,
                                      "--requests", str(requests), "--api-key", KEY, "--timeout", "120", "--json"])
    assert result.exit_code == 0, result.output
    checks = json.loads(result.stdout)["checks"]
    assert len(checks) == 3
    assert all(c["server_prompt"] == c["local_prompt"] for c in checks), checks
    assert all(c["agrees"] and c["prompt_cause"] is None for c in checks), checks


def _audit_with(server, tmp_path, tokenizer_dir):
    from typer.testing import CliRunner

    from sparseety.cli import app

    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."}, *CHAT], "max_tokens": 2})
                        + "\n" + json.dumps({"prompt": PROMPT, "max_tokens": 2}) + "\n")
    result = CliRunner().invoke(app, ["audit-usage", "--base-url", f"{server.url}/v1", "--model", MODEL,
                                      "--requests", str(requests), "--api-key", KEY, "--timeout", "120",
                                      "--tokenizer", str(tokenizer_dir), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_audit_usage_explains_a_different_chat_template(server, tmp_path):
    """The same vocabulary with a template that drops the role markers: the chat prompt disagrees, and the
    audit names the template; the completion request (no template) still agrees."""
    from sparseety.models import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "other-template")
    chat, completion = _audit_with(server, tmp_path, tmp_path / "other-template")["checks"]
    assert chat["server_prompt"] > chat["local_prompt"] and not chat["agrees"]
    assert chat["prompt_cause"].startswith("chat template differs"), chat
    assert completion["server_prompt"] == completion["local_prompt"]


def test_audit_usage_explains_a_different_vocabulary(server, tmp_path):
    """A word-level tokenizer built here: every count differs, and the audit blames the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for text in (PROMPT, *(m["content"] for m in CHAT)) for w in text.split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "words")
    report = _audit_with(server, tmp_path, tmp_path / "words")
    assert report["disagreements"] == 2
    for check in report["checks"]:
        assert check["server_prompt"] != check["local_prompt"]
        assert "vocabulary differs" in (check["prompt_cause"] or "") + (check["completion_cause"] or ""), check


def test_metrics_move_by_the_request(server, client):
    before = scrape(server.url)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    after = scrape(server.url)
    usage = reply.usage.model_dump()
    sparsity = usage["sparsity"]

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("sparseety:prompt_tokens_total{}") == usage["prompt_tokens"]
    assert moved("sparseety:generation_tokens_total{}") == usage["completion_tokens"] == 5
    assert moved("sparseety:request_success_total{finish_reason=length,finished_reason=length}") == 1
    assert moved("sparseety:time_to_first_token_seconds_count{}") == 1
    assert moved("sparseety:inter_token_latency_seconds_count{}") == 4
    assert moved("sparseety:e2e_request_latency_seconds_count{}") == 1
    assert moved("sparseety:evicted_positions_total{policy=streaming}") == sparsity["evicted_positions"]
    assert moved("sparseety:eviction_events_total{policy=streaming}") == sparsity["eviction_events"]
    assert moved("sparseety:kv_cache_bytes_dense_total{policy=streaming}") == sparsity["kv_cache_bytes_dense"]
    assert moved("sparseety:kv_cache_kept_fraction_sum{policy=streaming}") == pytest.approx(
        sparsity["kv_cache_bytes_peak"] / sparsity["kv_cache_bytes_dense"])
    # Sample rate 0: nothing sampled, but every request leaves its tier-1 row (counts and timings).
    assert moved("sparseety:trace_records_sampled_total{reason=sampled}") == 0
    assert moved("sparseety:trace_records_traced_total{}") == 1
    assert after["sparseety:num_requests_running{}"] == 0


def test_forced_trace_is_stored_with_genai_attributes_and_health_metrics(server):
    assert server.state.tracer.writer.flush(60)  # earlier requests' tier-1 rows are committed before the baseline
    before = scrape(server.url)
    reply = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3},
                 headers={"X-Request-Id": "forced-1", "X-Sparseety-Trace": "1"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "forced-1"
    assert reply.json()["id"] == "forced-1"
    assert server.state.tracer.writer.flush(60)
    after = scrape(server.url)
    stored = httpx.get(f"{server.url}/v1/traces/forced-1", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert stored["tier"] == 3 and "step_importance" in stored["arrays"]
    otel = stored["document"]["otel"]
    usage = reply.json()["usage"]
    assert otel["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert otel["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert otel["gen_ai.request.model"] == MODEL and otel["gen_ai.operation.name"] == "text_completion"
    assert otel["gen_ai.response.finish_reasons"] == ["length"]
    assert otel["sparseety.policy"] == "streaming" and otel["sparseety.trace_reason"] == "forced"
    assert stored["document"]["extraction_health"]["adjacent_overlap"]
    listed = httpx.get(f"{server.url}/v1/traces", params={"limit": 5}, headers={"Authorization": f"Bearer {KEY}"})
    assert "forced-1" in [row["request_id"] for row in listed.json()["data"]]

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("sparseety:trace_records_sampled_total{reason=forced}") == 1
    assert moved("sparseety:trace_records_traced_total{}") == 1
    assert moved("sparseety:trace_records_committed_total{}") == 1
    assert moved("sparseety:extraction_latency_seconds_count{}") == 1
    assert moved("sparseety:important_token_top1_hit_rate_count{}") == 1
    assert moved("sparseety:important_token_layer_overlap_count{layer=0}") == 1


def test_body_field_forces_a_trace_at_the_tier_it_names(server):
    reply = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                  "sparsity": {"trace": True, "tier": 2}},
                 headers={"X-Request-Id": "forced-2"})
    assert reply.status_code == 200
    assert server.state.tracer.writer.flush(60)
    stored = httpx.get(f"{server.url}/v1/traces/forced-2", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert stored["tier"] == 2 and stored["document"]["otel"]["gen_ai.operation.name"] == "chat"


def test_unsampled_request_keeps_only_its_tier_1_row(server):
    reply = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                 headers={"X-Request-Id": "plain-1"})
    assert reply.status_code == 200
    assert server.state.tracer.writer.flush(60)
    stored = httpx.get(f"{server.url}/v1/traces/plain-1", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert stored["tier"] == 1 and not stored["arrays"]  # counts and timings only
    assert stored["document"]["usage"]["completion_tokens"] == reply.json()["usage"]["completion_tokens"]
    assert stored["document"]["otel"]["gen_ai.usage.input_tokens"] == reply.json()["usage"]["prompt_tokens"]
    missing = httpx.get(f"{server.url}/v1/traces/never-sent", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"


def test_auth(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    assert post(server, "/v1/completions", body, key=None).status_code == 401
    assert post(server, "/v1/completions", body, key="wrong").status_code == 403
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/traces").status_code == 401
    assert httpx.get(f"{server.url}/v1/traces", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert httpx.get(f"{server.url}/v1/traces/forced-1", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    return error


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"sparsity": {"policy": "bogus"}}, "sparsity.policy", "bogus"),
    ({"sparsity": {"policy": "h2o", "budget": 0}}, "sparsity.budget", "greater than 0"),
    ({"sparsity": {"budget": 4, "ratio": 0.5}}, "sparsity.budget", "either"),
    ({"sparsity": {"policy": "streaming", "budget": 8, "options": {"sinks": 9}}}, "sparsity.budget", "sinks"),
    ({"sparsity": {"options": {"colour": 1}}}, "sparsity.options", "colour"),
    ({"sparsity": {"tier": 7}}, "sparsity.tier", "3"),
    ({"max_tokens": 0}, "max_tokens", "between 1 and 32"),
    ({"max_tokens": 33}, "max_tokens", "between 1 and 32"),
    ({"n": 2}, "n", "greedy"),
    ({"prompt": ["a", "b"]}, "prompt", "one string"),
    ({"prompt": "   "}, "prompt", "empty"),
    ({"temperature": 5}, "temperature", "2"),
    ({"prompt": "broken \ud800 text"}, "prompt", "Unicode"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
])
def test_bad_completion_bodies_get_400_naming_the_field(server, body, param, words):
    error = _error(post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body}),
                   400, param)
    assert words in error["message"] and error["type"] == "invalid_request_error"


def test_prompt_over_the_context_window(server):
    long_text = "hello " * 9000
    error = _error(post(server, "/v1/completions", {"model": MODEL, "prompt": long_text, "max_tokens": 2}), 400,
                   "prompt")
    assert error["code"] == "context_length_exceeded" and "8192" in error["message"]
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long_text}]})
    assert _error(chat, 400, "messages")["code"] == "context_length_exceeded"


def test_other_client_errors(server):
    _error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
    lone_surrogate = {"model": MODEL, "messages": [{"role": "user", "content": "hi \ud83d"}]}
    assert "Unicode" in _error(post(server, "/v1/chat/completions", lone_surrogate), 400, "messages")["message"]
    _error(post(server, "/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}), 404, "model")
    bad_json = post(server, "/v1/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
    assert _error(bad_json, 400, None)["message"].startswith("the request body is not JSON: ")
    streamed_error = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream": True,
                                                      "sparsity": {"policy": "bogus"}})
    assert streamed_error.headers["content-type"].startswith("application/json")
    _error(streamed_error, 400, "sparsity.policy")
    _error(post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT}, headers={"X-Request-Id": "../x"}),
           400, "X-Request-Id")


def test_oversized_bodies_get_413_declared_or_streamed(server):
    big = b'{"model": "' + b"x" * (65 * 1024) + b'"}'
    _error(post(server, "/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413, None)

    def chunks():
        for _ in range(70):
            yield b"x" * 1024

    _error(post(server, "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413,
           None)


def test_full_queue_answers_429_at_once(server):
    before = scrape(server.url).get("sparseety:request_rejected_total{reason=queue_full}", 0.0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "stream": True}
    with contextlib.ExitStack() as streams:  # max_concurrency 1 + max_queue 2: three streams take every place
        for _ in range(3):
            streams.enter_context(httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                                               headers={"Authorization": f"Bearer {KEY}"}))
        assert server.state.loop.running + server.state.loop.waiting == 3
        reply = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    error = _error(reply, 429, None)
    assert error["code"] == "rate_limit_exceeded" and reply.headers["retry-after"] == "1"
    assert scrape(server.url)["sparseety:request_rejected_total{reason=queue_full}"] == before + 1
    deadline = time.monotonic() + 120  # the streams' clients left: their requests leave at the next step
    while server.state.loop.running + server.state.loop.waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_trace_endpoints_are_off_without_a_key_and_redaction_reaches_the_store(engine, tmp_path):
    with live_server(engine, trace_dir=tmp_path / "t", sample_rate=1.0, redact=True) as srv:
        assert httpx.get(f"{srv.url}/v1/traces").status_code == 404
        assert httpx.get(f"{srv.url}/v1/traces/x", headers={"Authorization": "Bearer any"}).status_code == 404
        assert httpx.get(f"{srv.url}/v1/models").status_code == 200
        body = {"model": MODEL, "prompt": "Write to bob.smith@example.com about", "max_tokens": 2}
        assert post(srv, "/v1/completions", body, key=None, headers={"X-Request-Id": "secret-1"}).status_code == 200
        assert srv.state.tracer.writer.flush(60)
    stored = json.dumps(load_trace(tmp_path / "t", "secret-1").document)
    assert "bob.smith@example.com" not in stored and "[EMAIL]" in stored


def test_spans_reach_an_otlp_endpoint(engine):
    """Optional dependency: runs where opentelemetry-sdk and its OTLP/HTTP exporter are installed."""
    pytest.importorskip("opentelemetry.sdk.trace")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    Thread(target=collector.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
        with live_server(engine, otlp_endpoint=endpoint) as srv:  # stopping the server flushes the exporter
            reply = post(srv, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, key=None,
                         headers={"X-Request-Id": "span-1"})
            assert reply.status_code == 200
    finally:
        collector.shutdown()
    spans = [span for path, body in received if path == "/v1/traces"
             for rs in ExportTraceServiceRequest.FromString(body).resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    assert [span.name for span in spans] == [f"text_completion {MODEL}"]
    attributes = {kv.key: kv.value for kv in spans[0].attributes}
    usage = reply.json()["usage"]
    assert attributes["gen_ai.usage.input_tokens"].int_value == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"].int_value == 2
    assert attributes["gen_ai.response.id"].string_value == "span-1"
    assert [v.string_value for v in attributes["gen_ai.response.finish_reasons"].array_value.values] == ["length"]
    assert attributes["sparseety.policy"].string_value == "dense"
    assert spans[0].end_time_unix_nano > spans[0].start_time_unix_nano


def test_a_pruning_server_reports_pruned_tokens_and_matches_the_engine(engine):
    """``--prune-schedule`` and ``--attention-topk`` apply to every request; usage counts the pruned tokens."""
    from sparseety.policies import build_policy
    from sparseety.prune_schedule import parse_prune_schedule

    prompt = "Repeat after me, slowly and clearly: the quick brown fox jumps over the lazy dog near the river bank."
    with live_server(engine, policy="streaming", budget=BUDGET, prune_schedule="8:0.5", attention_topk=12) as srv:
        reply = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120).completions.create(
            model=MODEL, prompt=prompt, max_tokens=4)
    expected = engine.generate(encode_prompt(engine.tokenizer, prompt, False), build_policy("streaming", BUDGET),
                               max_new_tokens=4, tier=1, prune=parse_prune_schedule("8:0.5"), attention_topk=12)
    usage = reply.usage.model_dump()
    assert usage["sparsity"]["pruned_tokens"] == expected.pruned_tokens > 0
    assert usage["completion_tokens"] == len(expected.output_ids)
    assert reply.choices[0].text == expected.text


def test_trace_lookup_says_pending_before_the_commit_and_dropped_when_the_writer_dropped_it(engine, tmp_path):
    with live_server(engine, api_key=KEY, trace_dir=tmp_path / "t", sample_rate=1.0, trace_queue_size=1,
                     max_tokens_limit=4) as srv:
        writer = srv.state.tracer.writer
        writer.pause()  # nothing is committed while paused; the queue holds one record
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        assert post(srv, "/v1/completions", body, headers={"X-Request-Id": "kept-1"}).status_code == 200
        assert post(srv, "/v1/completions", body, headers={"X-Request-Id": "lost-2"}).status_code == 200
        pending = httpx.get(f"{srv.url}/v1/traces/kept-1", headers={"Authorization": f"Bearer {KEY}"})
        dropped = httpx.get(f"{srv.url}/v1/traces/lost-2", headers={"Authorization": f"Bearer {KEY}"})
        unknown = httpx.get(f"{srv.url}/v1/traces/never-seen", headers={"Authorization": f"Bearer {KEY}"})
        writer.resume()
        assert writer.flush(60)
        done = httpx.get(f"{srv.url}/v1/traces/kept-1", headers={"Authorization": f"Bearer {KEY}"})
    assert pending.status_code == 202 and pending.json() == {"request_id": "kept-1", "status": "pending"}
    assert dropped.status_code == 410 and dropped.json()["status"] == "dropped"
    assert dropped.json()["error"]["code"] == "trace_dropped"
    assert unknown.status_code == 404 and done.status_code == 200 and done.json()["request_id"] == "kept-1"


def test_refusals_caused_by_the_servers_settings_say_so_and_what_a_request_can_send(engine):
    """A policy option or --attention-topk set by the server is named as the server's, with the request field
    that gets past it (sparsity.options), never a command-line flag the client cannot set."""
    def refusal(srv, sparsity: dict) -> dict:
        reply = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "Name a colour.", "max_tokens": 2, "sparsity": sparsity})
        assert reply.status_code == 400, reply.text
        return reply.json()["error"]

    with live_server(engine, policy="kvzap", policy_opts={"threshold": "-3"}) as srv:
        error = refusal(srv, {"budget": 16})
        assert "threshold=-3 are this server's, set by its --policy-opt" in error["message"]
        assert "sparsity.budget" in error["message"] and "--budget" not in error["message"]
        assert error["param"] == "sparsity.budget"
        # sending the request's own options replaces the server's: the same budget is then accepted
        ok = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Name a colour.", "max_tokens": 2,
            "sparsity": {"budget": 16, "options": {"per_head": True}}})
        assert ok.status_code == 200, ok.text
    with live_server(engine, policy="streaming", budget=BUDGET, attention_topk=12) as srv:
        error = refusal(srv, {"policy": "kvzip", "budget": 16})
        assert "--attention-topk" in error["message"] and '{"per_head": false}' in error["message"]
        assert error["param"] == "sparsity.options"
        assert "set its option" not in error["message"]
