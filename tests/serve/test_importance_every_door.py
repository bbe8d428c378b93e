"""The importance mode a trace records is the same from every door with no flags: ``SparseEngine.generate``,
``sparseety serve`` and ``sparseety run`` all record ``value`` (issue 38: the Python door recorded
``attention``). Real default model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest
from serve_helpers import MODEL, live_server
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.engine import encode_prompt
from sparseety.store import load_trace, write_trace

pytestmark = pytest.mark.model
PROMPT = "Count with me: one, two, three,"


def recorded(trace_dir: Path, request_id: str) -> str:
    return load_trace(trace_dir, request_id).document["provenance"]["extraction"]["importance"]


def test_every_door_records_value(engine, tmp_path: Path):
    result = engine.generate(encode_prompt(engine.tokenizer, PROMPT, False), max_new_tokens=2)
    write_trace(result, tmp_path / "python")
    with live_server(engine, trace_dir=tmp_path / "serve", sample_rate=1.0) as server:
        response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                              headers={"X-Request-Id": "door-serve"}, timeout=120)
        assert response.status_code == 200
        assert server.state.tracer.writer.flush(60)
    run = CliRunner().invoke(app, ["run", "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "2", "--json",
                                   "--trace-dir", str(tmp_path / "run"), "--no-report"])
    assert run.exit_code == 0, run.output
    run_id = json.loads(run.stdout.strip().splitlines()[-1])["request_id"]
    modes = {recorded(tmp_path / "python", result.request_id), recorded(tmp_path / "serve", "door-serve"),
             recorded(tmp_path / "run", run_id)}
    assert modes == {"value"}
