"""Bounded load on a loopback server: no errors, every sampled request stored, memory bounded; and a server
killed mid-load (SIGKILL) leaves a readable store in which every committed trace loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import psutil
import pytest
from serve_helpers import MODEL, live_server, scrape

from sparseety.store import connect, list_traces, load_trace, should_sample

CLIENTS, REQUESTS, RATE = 8, 4, 0.3
PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Give me a color."]


def test_concurrent_clients_get_answers_and_every_sampled_request_is_stored(engine, tmp_path):
    trace_dir = tmp_path / "traces"
    process = psutil.Process()
    with live_server(engine, trace_dir=trace_dir, sample_rate=RATE, max_concurrency=2, max_queue=CLIENTS) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)

        def one_client(c: int, rounds: range) -> list[tuple[str, int]]:
            done = []
            for i in rounds:
                request_id = f"load-{c}-{i}"
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": PROMPTS[(c + i) % len(PROMPTS)]}],
                    max_tokens=4, extra_headers={"X-Request-Id": request_id})
                done.append((reply.id, reply.usage.completion_tokens))
            return done

        def load(rounds: range) -> list[tuple[str, int]]:
            with ThreadPoolExecutor(CLIENTS) as pool:
                futures = [pool.submit(one_client, c, rounds) for c in range(CLIENTS)]
                return [pair for f in futures for pair in f.result(timeout=600)]  # a hang guard, not a speed test

        # The first half warms up (allocator pools, kernels, Parquet and DuckDB imports); the second half
        # runs the same load again, and must not grow memory much further.
        answers = load(range(REQUESTS // 2))
        rss_warm = process.memory_info().rss
        answers += load(range(REQUESTS // 2, REQUESTS))
        rss_growth = process.memory_info().rss - rss_warm
        assert srv.state.tracer.writer.flush(120)
        metrics = scrape(srv.url)

    ids = [request_id for request_id, _ in answers]
    assert sorted(ids) == sorted(f"load-{c}-{i}" for c in range(CLIENTS) for i in range(REQUESTS))
    assert all(1 <= tokens <= 4 for _, tokens in answers)
    sampled = {request_id for request_id in ids if should_sample(request_id, RATE)}
    assert sampled, "the fixed ids must include sampled ones"
    rows = list_traces(trace_dir, limit=1000)
    assert {row["request_id"] for row in rows} == set(ids), "every request leaves at least its tier-1 row"
    assert {row["request_id"] for row in rows if row["tier"] >= 2} == sampled
    for request_id in sampled:
        trace = load_trace(trace_dir, request_id)
        assert trace.tier == 2 and "importance" in trace.arrays
    total = sum(v for k, v in metrics.items() if k.startswith("sparseety:request_success_total"))
    assert total == CLIENTS * REQUESTS
    assert metrics["sparseety:trace_records_sampled_total{reason=sampled}"] == len(sampled)
    assert metrics["sparseety:trace_records_dropped_total{}"] == 0
    assert metrics["sparseety:num_requests_waiting{}"] == 0
    assert rss_growth < 150 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB in the second half"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, deadline_s: float = 180) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited: {server.stderr.read().decode(errors='replace')}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError("the server did not become healthy")


@pytest.mark.model  # runs the real default model (through the command line)
def test_sigkill_mid_load_keeps_every_committed_trace(tmp_path):
    trace_dir, port = tmp_path / "traces", _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "sparseety"), "serve", "--port", str(port), "--trace-dir",
               str(trace_dir), "--sample-rate", "1.0", "--max-concurrency", "2", "--max-tokens-limit", "8"]
    env = {k: v for k, v in os.environ.items() if k != "SPARSEETY_API_KEY"}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    stop = threading.Event()
    try:
        _wait_healthy(url, server)

        def hammer(c: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[c], "max_tokens": 3},
                               headers={"X-Request-Id": f"kill-{c}-{i}"}, timeout=60)
                except httpx.TransportError:
                    return
                i += 1

        clients = [threading.Thread(target=hammer, args=(c,), daemon=True) for c in range(3)]
        for thread in clients:
            thread.start()
        committed, deadline = 0.0, time.monotonic() + 300
        while committed < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
            committed = scrape(url).get("sparseety:trace_records_committed_total{}", 0.0)
        assert committed >= 3, "nothing was committed before the deadline"
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=60)
    finally:
        stop.set()
        if server.poll() is None:
            server.kill()
            server.wait(timeout=60)
        server.stderr.close()

    rows = list_traces(trace_dir, limit=10_000)
    assert len(rows) >= committed
    for row in rows:
        trace = load_trace(trace_dir, row["request_id"])
        assert trace.request_id == row["request_id"] and trace.tier in (1, 2)
        assert trace.document["otel"]["gen_ai.usage.output_tokens"] == row["completion_tokens"]
    with connect(trace_dir) as con:
        assert con.execute("SELECT count(DISTINCT request_id) FROM token_events").fetchone()[0] <= len(rows)


@pytest.mark.parametrize(("args", "message"), [
    (["--budget", "4", "--ratio", "0.5"], "either budget or ratio"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--policy", "h2o"], "needs --budget"),
    (["--sample-rate", "2", "--trace-dir", "unused"], "--sample-rate must be less than or equal to 1"),
    (["--sample-rate", "0.5"], "give --trace-dir too"),
    (["--policy-opt", "sinks"], "key=value"),
])
def test_cli_refuses_bad_settings_before_loading_the_model(args, message):
    from typer.testing import CliRunner

    from sparseety.cli import app

    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2
    assert "error:" in result.output and message in result.output


def test_cli_names_the_packages_an_otlp_endpoint_needs():
    """The OpenTelemetry SDK is optional: without it (hidden from imports here) --otlp-endpoint is a clear error."""
    hide = ("import sys; sys.modules['opentelemetry.sdk'] = None; "
            "sys.modules['opentelemetry.exporter.otlp.proto.http.trace_exporter'] = None; "
            "sys.argv = ['sparseety', 'serve', '--otlp-endpoint', 'http://127.0.0.1:4318/v1/traces']; "
            "from sparseety.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "error:" in done.stderr and "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http" in done.stderr
