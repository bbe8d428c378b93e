"""Nothing generated is lost to the trace directory: it is checked before the model loads, and a write that
fails after generating still prints the answer (a ``warning:`` line, exit code 1)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.errors import InputError
from sparseety.store.dataset import check_trace_dir

NO_MODEL = "/no/such/model"  # a trace-dir error instead of this model's proves the check ran before loading


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def immutable_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder nothing can be created in, even by root (``chattr +i``): ``os.access`` says writable."""
    folder = tmp_path / "immutable"
    folder.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.fixture
def half_broken(tmp_path: Path) -> Path:
    """A trace dir the pre-flight check accepts but a trace write fails in: its ``requests`` table is a file."""
    root = tmp_path / "traces"
    root.mkdir()
    (root / "requests").write_text("not a folder")
    return root


def _unusable(tmp_path: Path, kind: str) -> tuple[str, str]:
    if kind == "file":
        path = tmp_path / "a-file"
        path.write_text("x")
        return str(path), f"--trace-dir {path} is not a directory"
    if kind == "loop":  # os.path.exists says no, so a check that looked only at the parent let it through
        path = tmp_path / "loop"
        path.symlink_to(path)
        return str(path), f"--trace-dir {path} is a symbolic link loop"
    if kind == "empty":  # Path("") is the current folder: a dataset used to land there
        return "", "Invalid value for '--trace-dir': is empty; give a directory"
    proc = Path("/proc/self/sparseety-traces")
    return str(proc), f"--trace-dir {proc} is inside /proc, a pseudo file system"


@pytest.mark.parametrize("kind", ["file", "proc", "loop", "empty"])
@pytest.mark.parametrize("command", ["run", "batch", "compare", "serve"])
def test_an_unusable_trace_dir_is_refused_before_the_model_loads(tmp_path: Path, kind: str, command: str):
    path, message = _unusable(tmp_path, kind)
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"prompt": "Hi"}\n')
    args = {"run": ["run", "--prompt", "Hi"], "batch": ["run", "--batch-file", str(batch)],
            "compare": ["compare", "--prompt", "Hi", "--policy", "streaming", "--budget", "8"],
            "serve": ["serve"]}[command]
    result = invoke(*args, "--model", NO_MODEL, "--trace-dir", path)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}")
    assert NO_MODEL not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_an_immutable_trace_dir_is_refused(immutable_dir: Path):
    result = invoke("run", "--prompt", "Hi", "--model", NO_MODEL, "--trace-dir", str(immutable_dir))
    assert result.exit_code == 2
    assert result.stderr == f"error: --trace-dir {immutable_dir} is not writable: Operation not permitted\n"
    with pytest.raises(InputError, match="cannot be created in .*immutable: Operation not permitted"):
        check_trace_dir(immutable_dir / "sub" / "deeper")


def test_the_check_creates_nothing_and_wants_free_space(tmp_path: Path):
    check_trace_dir(tmp_path / "new" / "traces")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InputError, match=r"--trace-dir .* MiB free, less than the 1048576 MiB it must have"):
        check_trace_dir(tmp_path, min_free=1 << 40)


@pytest.mark.model  # runs the real default model (through the command line)
def test_tier_0_needs_no_trace_dir():
    result = invoke("run", "--prompt", "Hi", "--tier", "0", "--max-new-tokens", "2", "--no-chat", "--json",
                    "--trace-dir", "/proc/self/sparseety-traces")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["trace_path"] is None


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_trace_that_fails_after_generating_still_prints_the_answer(half_broken: Path):
    args = ["run", "--prompt", "Name three colours.", "--max-new-tokens", "4", "--no-chat", "--trace-dir",
            str(half_broken)]
    result = invoke(*args, "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["trace_path"] is None and len(doc["output_token_ids"]) == 4 and doc["text"]
    assert doc["trace_error"].startswith("[Errno 20] Not a directory:")
    assert result.stderr == f"warning: trace of {doc['request_id']} not written: {doc['trace_error']}\n"
    table = invoke(*args)
    assert table.exit_code == 1
    assert table.stdout.startswith(doc["text"]) and "summary" in table.stdout and "trace: " not in table.stdout
    assert "warning: trace of " in table.stderr and " not written: [Errno 20] Not a directory" in table.stderr


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_batch_whose_traces_fail_prints_every_answer(tmp_path: Path, half_broken: Path):
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"prompt": "Name three colours.", "request_id": "a"}\n{"prompt": "Hi", "request_id": "b"}\n')
    result = invoke("run", "--batch-file", str(batch), "--max-new-tokens", "3", "--no-chat", "--json",
                    "--trace-dir", str(half_broken))
    assert result.exit_code == 1, result.output
    docs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["request_id"], d["trace_path"], len(d["output_token_ids"])) for d in docs] == [("a", None, 3),
                                                                                              ("b", None, 3)]
    warnings = result.stderr.splitlines()
    assert [w.split(" not written: ")[0] for w in warnings] == ["warning: trace of a", "warning: trace of b"]
    assert all(d["trace_error"] in w for d, w in zip(docs, warnings))


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_comparison_whose_traces_fail_is_printed_anyway(half_broken: Path):
    result = invoke("compare", "--prompt", "Name three colours.", "--policy", "streaming", "--budget", "8",
                    "--max-new-tokens", "3", "--no-chat", "--json", "--trace-dir", str(half_broken))
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["trace_error"].startswith("[Errno 20] Not a directory:") and doc["report_path"] is None
    assert "fidelity" in doc
    assert result.stderr.splitlines()[-1] == ("warning: the traces of this comparison were not all written: "
                                              + doc["trace_error"])
