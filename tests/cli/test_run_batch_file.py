"""``sparseety run --batch-file``: one continuous batch on the default model, one trace per request, bad lines alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


@pytest.mark.model  # runs the real default model (through the command line)
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


@pytest.mark.model  # runs the real default model (through the command line)
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


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_line_refused_by_the_engine_is_reported_alone_and_the_others_run(tmp_path: Path):
    """A line the model cannot run (more tokens than its context) is refused when it joins the batch."""
    batch = write(tmp_path / "prompts.jsonl", [
        LINES[0],
        {"prompt": "hi", "policy": "tova", "budget": 16, "max_new_tokens": 1 << 20, "request_id": "long"},
        {"prompt": "Say hello.", "request_id": "hello"},
    ])
    result = invoke("--batch-file", str(batch), "--max-new-tokens", "3", "--trace-dir", str(tmp_path / "t"),
                    "--json", "--no-report", "--no-chat")
    assert result.exit_code == 2
    errors = result.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {batch} line 2: the prompt (")
    assert "plus max_new_tokens (1048576) exceeds the model's context" in errors[0]
    docs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [d["request_id"] for d in docs] == ["colours", "hello"]
    assert all(load_trace(tmp_path / "t", d["request_id"]).request_id == d["request_id"] for d in docs)


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_line_that_is_not_utf8_is_refused_alone(tmp_path: Path):
    batch = tmp_path / "prompts.jsonl"
    batch.write_bytes(b'\xef\xbb\xbf{"prompt": "Hi", "request_id": "first"}\n{"prompt": "caf\xe9"}\n'
                      b'{"prompt": "Hi", "request_id": "third"}\n')
    result = invoke("--batch-file", str(batch), "--max-new-tokens", "2", "--trace-dir", str(tmp_path / "t"),
                    "--json", "--no-report", "--no-chat")
    assert result.exit_code == 2
    assert result.stderr == f"error: {batch} line 2: not UTF-8 (byte 0xe9 at column 16)\n"
    assert [json.loads(line)["request_id"] for line in result.stdout.splitlines()] == ["first", "third"]


@pytest.mark.model  # runs the real default model (through the command line)
def test_lines_the_server_would_refuse_are_refused(tmp_path: Path):
    """Roles and duplicate keys are checked as the server checks them (one shared definition)."""
    batch = write(tmp_path / "prompts.jsonl", [
        {"messages": [{"role": "wizard", "content": "hi"}]},
        '{"prompt": "x", "prompt": "y"}',
        '{"messages": [{"role": "user", "content": "a", "role": "system"}]}',
        LINES[0],
    ])
    result = invoke("--batch-file", str(batch), "--max-new-tokens", "2", "--trace-dir", str(tmp_path / "t"),
                    "--json", "--no-report", "--no-chat")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: {batch} line 1: messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or "
        "'tool'",
        f"error: {batch} line 2: the line gives the key 'prompt' twice",
        f"error: {batch} line 3: the line gives the key 'role' twice",
    ]
    assert [json.loads(line)["request_id"] for line in result.stdout.splitlines()] == ["colours"]


@pytest.mark.model  # runs the real default model (through the command line)
def test_an_over_long_line_is_refused_by_its_size_before_tokenizing(tmp_path: Path):
    huge = "word " * 400_000  # 2,000,000 bytes: more than 128 bytes for each of the 8192 tokens of context
    batch = write(tmp_path / "prompts.jsonl", [{"prompt": huge}, {"messages": [{"role": "user", "content": huge}]},
                                               LINES[0]])
    result = invoke("--batch-file", str(batch), "--max-new-tokens", "2", "--trace-dir", str(tmp_path / "t"),
                    "--json", "--no-report", "--no-chat")
    assert result.exit_code == 2
    bound = ("is 2000000 bytes, more than the 1048576 bytes the model's context of 8192 tokens can hold (128 bytes a "
             "token at most); refused before tokenizing")
    assert result.stderr.splitlines() == [f"error: {batch} line 1: the prompt {bound}",
                                          f"error: {batch} line 2: the messages' content {bound}"]
    assert [json.loads(line)["request_id"] for line in result.stdout.splitlines()] == ["colours"]


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_request_that_fails_in_the_batch_is_reported_alone_and_the_others_are_traced(tmp_path: Path, monkeypatch):
    """A fault injected into one line's policy (its ``score`` raises mid-decode) fails that request only."""
    from dataclasses import dataclass
    from typing import ClassVar

    from sparseety.policies import registry
    from sparseety.policies.h2o import H2OPolicy

    @dataclass
    class Faulty(H2OPolicy):
        name: ClassVar[str] = "faulty"

        def score(self, obs):
            if obs.step >= 2:
                raise RuntimeError(f"injected fault at step {obs.step}")
            return super().score(obs)

    monkeypatch.setitem(registry._POLICIES, "faulty", Faulty)
    batch = write(tmp_path / "prompts.jsonl", [
        LINES[0], {"prompt": "Say hello in French.", "policy": "faulty", "budget": 16, "request_id": "bad"},
        {"prompt": "Say hello.", "request_id": "hello"},
    ])
    result = invoke("--batch-file", str(batch), "--max-new-tokens", "4", "--trace-dir", str(tmp_path / "t"),
                    "--json", "--no-report", "--no-chat")
    assert result.exit_code == 2
    assert result.stderr == (f"error: {batch} line 2: request bad failed at decode (after 2 tokens): "
                             "injected fault at step 2\n")
    docs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["request_id"], len(d["output_token_ids"])) for d in docs] == [("colours", 4), ("hello", 4)]
    assert all(load_trace(tmp_path / "t", d["request_id"]).request_id == d["request_id"] for d in docs)


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_request_id_the_store_holds_is_refused_as_the_server_refuses_it(tmp_path: Path):
    """One id, one trace: a line whose request_id is already stored is refused alone (the server answers 409),
    and the store keeps its one row for that id."""
    from sparseety.store import connect

    batch = write(tmp_path / "prompts.jsonl", [LINES[0], {"prompt": "Say hello."}])
    first = invoke("--batch-file", str(batch), "--max-new-tokens", "2", "--trace-dir", str(tmp_path / "t"),
                   "--json", "--no-report", "--no-chat")
    assert first.exit_code == 0, first.output
    again = invoke("--batch-file", str(batch), "--max-new-tokens", "2", "--trace-dir", str(tmp_path / "t"),
                   "--json", "--no-report", "--no-chat")
    assert again.exit_code == 2, again.output
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and " line 1: request_id 'colours' is already in the trace store" in errors[0]
    assert len(again.stdout.splitlines()) == 1  # the other line ran
    rows = connect(tmp_path / "t").sql("SELECT request_id FROM requests WHERE request_id = 'colours'").fetchall()
    assert len(rows) == 1
