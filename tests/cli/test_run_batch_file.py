"""``sparseety run --batch-file``: one continuous batch on the default model, one trace per request, bad lines alone."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.store import load_trace

LINES = [
    {"prompt": "Name three colours.", "request_id": "colours"},
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "policy": "streaming", "budget": 16,
     "request_id": "sum", "max_new_tokens": 4},
    {"prompt": "Say hello in French.", "policy": "h2o", "ratio": 0.5},
]


def invoke(*args: str):
    return CliRunner().invoke(app, ["run", *args])


def write(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_a_batch_file_runs_as_one_batch_and_equals_each_request_alone(tmp_path: Path):
    batch = write(tmp_path / "prompts.jsonl", LINES)
    result = invoke("--batch-file", str(batch), "--max-new-tokens", "6", "--trace-dir", str(tmp_path / "t"),
                    "--json", "--no-report", "--no-chat")
    assert result.exit_code == 0, result.output
    docs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [d["request_id"] for d in docs[:2]] == ["colours", "sum"] and len(docs) == 3
    assert [d["sparsity"]["policy"] for d in docs] == ["dense", "streaming", "h2o"]
    assert [d["usage"]["completion_tokens"] for d in docs] == [6, 4, 6]
    for doc in docs:  # one trace per request, loadable
        assert load_trace(tmp_path / "t", doc["request_id"]).request_id == doc["request_id"]
    alone = invoke("--prompt", "Name three colours.", "--max-new-tokens", "6", "--trace-dir", str(tmp_path / "a"),
                   "--json", "--no-report", "--no-chat")
    assert json.loads(alone.stdout)["output_token_ids"] == docs[0]["output_token_ids"]


def test_bad_lines_are_reported_alone_and_the_rest_run(tmp_path: Path):
    batch = write(tmp_path / "prompts.jsonl", [
        LINES[0],
        "{not json",
        {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
        {"prompt": "hi", "colour": "red"},
        {"prompt": "hi", "budget": -3, "policy": "streaming"},
        {"prompt": "Name three colours.", "request_id": "colours"},
        {"prompt": "hi", "policy": "no-such-policy"},
    ])
    result = invoke("--batch-file", str(batch), "--max-new-tokens", "3", "--trace-dir", str(tmp_path / "t"),
                    "--json", "--no-report")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert [e.split(" line ")[1].split(":")[0] for e in errors] == ["2", "3", "4", "5", "6", "7"]
    assert "not JSON" in errors[0] and "exactly one of 'prompt' or 'messages'" in errors[1]
    assert "unknown key 'colour'" in errors[2] and "budget" in errors[3] and "appears twice" in errors[4]
    assert "no-such-policy" in errors[5]
    assert [json.loads(line)["request_id"] for line in result.stdout.splitlines()] == ["colours"]


def test_batch_file_flags_that_cannot_combine_are_refused(tmp_path: Path):
    batch = write(tmp_path / "prompts.jsonl", LINES[:1])
    for extra, message in ((["--speculative", "3"], "--speculative cannot be combined with --batch-file"),
                           (["--prompt", "x"], "leave out --prompt")):
        result = invoke("--batch-file", str(batch), *extra, "--trace-dir", str(tmp_path))
        assert result.exit_code == 2 and message in result.output
    empty = write(tmp_path / "empty.jsonl", [""])
    result = invoke("--batch-file", str(empty), "--trace-dir", str(tmp_path))
    assert result.exit_code == 2 and "holds no requests" in result.output
