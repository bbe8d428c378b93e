"""The server's trace store: refused at start-up when it cannot be written; a write that fails later loses
only the trace: the answer is returned, the failure logged once, and the trace endpoint says ``dropped`` and why."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx2 as httpx
import pytest
from serve_helpers import MODEL, live_server, scrape

from sparseety.errors import InputError
from sparseety.serve import ServeConfig
from sparseety.serve.tracing import Tracer

KEY = "test-key"


def test_an_unwritable_trace_dir_is_refused_before_the_server_starts(tmp_path: Path):
    with pytest.raises(InputError) as info:
        Tracer(ServeConfig(model=MODEL, trace_dir=Path("/proc/self/sparseety-traces")))
    assert str(info.value).startswith("--trace-dir /proc/self/sparseety-traces is inside /proc, a pseudo file system")
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with pytest.raises(InputError) as info:
        Tracer(ServeConfig(model=MODEL, trace_dir=afile / "traces"))
    assert f"cannot be created: {afile} is a file, not a directory" in str(info.value)


def test_a_failed_trace_write_returns_the_answer_and_the_trace_says_dropped(engine, tmp_path: Path, caplog):
    root = tmp_path / "t"
    root.mkdir()
    (root / "requests").write_text("a file where the requests table goes")  # passes the start-up check
    body = json.dumps({"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 2}).encode()
    auth = {"Authorization": f"Bearer {KEY}"}
    with caplog.at_level(logging.ERROR, logger="sparseety.serve.tracing"), \
            live_server(engine, api_key=KEY, trace_dir=root, sample_rate=1.0) as srv:
        replies = [httpx.post(f"{srv.url}/v1/completions", content=body, timeout=120,
                              headers=auth | {"Content-Type": "application/json", "X-Request-Id": f"r-{i}"})
                   for i in range(2)]
        assert srv.state.tracer.writer.flush(60)
        trace = httpx.get(f"{srv.url}/v1/traces/r-0", headers=auth, timeout=30)
        metrics = scrape(srv.url)
    assert [r.status_code for r in replies] == [200, 200]
    assert all(r.json()["choices"][0]["text"] and r.json()["usage"]["completion_tokens"] == 2 for r in replies)
    assert trace.status_code == 410
    doc = trace.json()
    assert doc["status"] == "dropped" and doc["error"]["code"] == "trace_dropped"
    assert doc["reason"].startswith("the write failed: NotADirectoryError: [Errno 20] Not a directory")
    assert doc["error"]["message"].startswith(f"this request's trace was dropped: {doc['reason']}")
    logged = [r.getMessage() for r in caplog.records if r.name == "sparseety.serve.tracing"]
    assert len(logged) == 1  # once, though both requests' traces failed
    expected = rf"traces of [12] request\(s\) not written to {re.escape(str(root))}: NotADirectoryError"
    assert re.match(expected, logged[0])
    assert metrics["sparseety:trace_records_dropped_total{}"] == 2
