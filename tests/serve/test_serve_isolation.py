"""Issue 25 at the server: one id, one trace (409); a non-streaming client that leaves frees its slot; sizes
and messages before any work; a quiet shutdown on SIGINT/SIGTERM (a real ``sparseety serve`` process)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from serve_helpers import MODEL, live_server, scrape

from sparseety.store import list_traces, load_trace

PROMPT = "Count with me: one, two, three, four,"
ABORTED = "sparseety:request_aborted_total{reason=client_disconnected}"


def post(url: str, body: dict | None = None, *, request_id: str | None = None, content: bytes | None = None,
         content_type: str = "application/json", path: str = "/v1/completions") -> httpx.Response:
    headers = {"Content-Type": content_type}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    data = content if content is not None else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=data, headers=headers, timeout=120)


def error_of(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return error


def wait_until(condition, what: str, limit_s: float = 120) -> None:
    """A hang guard, not a timing assertion."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


# -- finding 6: a non-streaming client that leaves -------------------------------------------------------


def test_a_non_streaming_client_that_leaves_frees_its_slot_and_reservation(engine):
    with live_server(engine, max_tokens_limit=250, kv_memory_limit="1GiB") as srv:
        before = scrape(srv.url).get(ABORTED, 0)
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 250}).encode()
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_until(lambda: srv.state.loop.running == 1, "the request entered the batch")
            assert srv.state.loop.batch.reserved_bytes > 0
        # The client is gone: the request must leave the batch and free its reservation, not run 250 tokens.
        wait_until(lambda: srv.state.loop.running == 0, "the request left the batch")
        metrics = scrape(srv.url)
        assert metrics[ABORTED] - before == 1
        assert metrics["sparseety:kv_cache_reserved_bytes{}"] == 0
        assert metrics.get("sparseety:request_success_total{finish_reason=length,finished_reason=length}", 0) == 0


# -- finding 4: one id, one trace ---------------------------------------------------------------------------


def test_a_request_id_runs_once_while_running_or_stored(engine, tmp_path):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    with live_server(engine, trace_dir=tmp_path, sample_rate=1.0, max_tokens_limit=32) as srv:
        assert post(srv.url, body, request_id="dup-1").status_code == 200
        again = error_of(post(srv.url, body, request_id="dup-1"), 409, "X-Request-Id")
        assert again["code"] == "request_id_in_use"
        assert again["message"] == ("X-Request-Id 'dup-1' is already in use: a request with this id is stored in "
                                    "the trace store; send a new id (or none, and the server makes one)")
        stream = {**body, "max_tokens": 32, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=stream, headers={"X-Request-Id": "dup-2"},
                          timeout=120) as running:
            assert running.status_code == 200
            while_running = error_of(post(srv.url, body, request_id="dup-2"), 409, "X-Request-Id")
            assert "a request with this id is still running" in while_running["message"]
        # A request refused before it ran leaves its id free.
        error_of(post(srv.url, {**body, "max_tokens": 0}, request_id="dup-3"), 400, "max_tokens")
        assert post(srv.url, body, request_id="dup-3").status_code == 200
        srv.state.tracer.writer.flush(60)
    assert [r["request_id"] for r in list_traces(tmp_path) if r["request_id"] == "dup-1"] == ["dup-1"]
    assert load_trace(tmp_path, "dup-1").request_id == "dup-1"
    with live_server(engine, trace_dir=tmp_path, sample_rate=1.0) as restarted:  # the store's ids, read at start
        assert error_of(post(restarted.url, body, request_id="dup-3"), 409, "X-Request-Id")["code"] == \
            "request_id_in_use"


def test_without_a_trace_store_an_id_is_refused_only_while_it_runs(engine):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    with live_server(engine) as srv:
        assert post(srv.url, body, request_id="again").status_code == 200
        assert post(srv.url, body, request_id="again").status_code == 200


# -- findings 7 and 9: sizes and messages -------------------------------------------------------------------


def test_body_and_field_messages_name_the_field_and_the_limit(engine):
    with live_server(engine, max_tokens_limit=32, max_body_bytes=2 << 20) as srv:
        url = srv.url
        huge_float = post(url, content=b'{"model": "%s", "prompt": "hi", "max_tokens": 1e20}' % MODEL.encode())
        assert error_of(huge_float, 400, "max_tokens")["message"] == \
            "max_tokens must be an integer between 1 and 32, got 1e+20"
        huge_int = post(url, {"model": MODEL, "prompt": "hi", "max_tokens": 10**20})
        assert error_of(huge_int, 400, "max_tokens")["message"] == \
            "max_tokens must be between 1 and 32 (this server's --max-tokens-limit), got 100000000000000000000"
        chat = post(url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99},
                    path="/v1/chat/completions")
        assert "max_completion_tokens must be between 1 and 32" in error_of(chat, 400, "max_completion_tokens")["message"]
        plain = post(url, {"model": MODEL, "prompt": "hi"}, content_type="text/plain")
        assert error_of(plain, 400, None)["message"] == \
            "the request body must be JSON sent with Content-Type: application/json, got 'text/plain'"
        twice = post(url, content=b'{"model": "%s", "prompt": "a", "prompt": "b"}' % MODEL.encode())
        assert error_of(twice, 400, None)["message"] == "the request body gives the key 'prompt' twice"
        nested = b'{"model": "%s", "messages": [{"role": "user", "content": "a", "role": "system"}]}' % MODEL.encode()
        assert "gives the key 'role' twice" in error_of(post(url, content=nested, path="/v1/chat/completions"), 400,
                                                         None)["message"]
        not_json = post(url, content=b'{"model": ')
        assert error_of(not_json, 400, None)["message"].startswith("the request body is not JSON: ")
        # Far more text than the model's context (8192 tokens) could hold: refused by bytes, before tokenizing.
        text = "a" * (128 * 8192 + 1)
        long_prompt = error_of(post(url, {"model": MODEL, "prompt": text}), 400, "prompt")
        assert long_prompt["code"] == "context_length_exceeded"
        assert long_prompt["message"] == (
            f"the prompt text is {len(text)} bytes, more than the {128 * 8192} bytes the model's context of 8192 "
            "tokens can hold (128 bytes a token at most); refused before tokenizing")
        messages = [{"role": "system", "content": text[:600_000]}, {"role": "user", "content": text[600_000:]}]
        long_chat = post(url, {"model": MODEL, "messages": messages}, path="/v1/chat/completions")
        assert f"the messages text is {len(text)} bytes" in error_of(long_chat, 400, "messages")["message"]


# -- finding 8: a quiet shutdown ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.model  # runs the real default model (through the command line)
def test_serve_stops_quietly_and_running_requests_get_a_clean_503(tmp_path, stop):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("sparseety")
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--trace-dir", str(tmp_path / "t")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "the server started", limit_s=300)
        answers: dict[str, object] = {}
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 250}

        def plain() -> None:
            answers["plain"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                answers["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")][-2:]

        clients = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for client in clients:
            client.start()
        wait_until(lambda: httpx.get(f"{url}/health", timeout=10).json()["running"] == 2, "both requests running")
        proc.send_signal(stop)
        _, stderr = proc.communicate(timeout=120)
        for client in clients:
            client.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    name = signal.Signals(stop).name
    assert [line for line in stderr.splitlines() if "shutting down" in line] == [
        f"sparseety serve: {name} received, shutting down (running requests end with a 503 error)"]
    message = "the server is shutting down: this request was stopped before it finished: send it again later"
    reply = answers["plain"]
    assert reply.status_code == 503 and reply.json()["error"]["message"] == message
    last_event, done = answers["stream"]
    assert json.loads(last_event.removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert done == "data: [DONE]"


def test_a_body_without_a_content_type_is_named(engine):
    """No Content-Type header: the message names the request body and the header it needs, not a bare
    "Input should be a valid dictionary"."""
    with live_server(engine, max_tokens_limit=8) as srv:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        response = httpx.post(f"{srv.url}/v1/completions", content=body, timeout=120)
        assert "content-type" not in {k.lower() for k in response.request.headers}
        error = error_of(response, 400, None)
        assert "request body" in error["message"] and "Content-Type: application/json" in error["message"]
        assert "no Content-Type" in error["message"] and "valid dictionary" not in error["message"]
