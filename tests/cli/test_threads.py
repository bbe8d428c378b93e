"""Every command that runs a model chooses its torch threads on purpose (``--threads``, else cores - 1) and
says so in one stderr line, never in ``--json`` stdout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.errors import InputError
from sparseety.threads import available_cores, choose_threads, describe_threads

#: every command that runs a model forward, with the least it needs besides --threads
MODEL_COMMANDS = [
    ["run", "--prompt", "hi"],
    ["compare", "--prompt", "hi"],
    ["tune", "--metric", "mean_kl", "--threshold", "0.1", "--policy", "h2o", "--prompt", "hi"],
    ["bench", "passkey"],
    ["bench", "ruler"],
    ["learn-policy", "traces", "-o", "p.safetensors"],
    ["serve"],
]


@pytest.fixture
def torch_threads():
    """Restore torch's thread count after an in-process command changed it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_the_default_leaves_one_core_free():
    assert [choose_threads(None, cores) for cores in (1, 2, 16)] == [1, 1, 15]
    assert choose_threads(3, cores=2) == 3
    assert describe_threads(1, None, 2) == "threads: 1 (of 2 cores, one left free; --threads sets it)"
    assert describe_threads(1, None, 1) == "threads: 1 (of 1 core; --threads sets it)"
    assert describe_threads(4, 4, 2) == "threads: 4 (of 2 cores, more threads than cores; set by --threads)"
    with pytest.raises(InputError, match=r"^--threads must be from 1 to 1024 threads, got 0$"):
        choose_threads(0)


@pytest.mark.model  # runs the real default model (through the command line)
def test_run_sets_and_says_the_threads_it_chose(tmp_path: Path, torch_threads):
    args = ["run", "--prompt", "Hi", "--max-new-tokens", "2", "--no-chat", "--no-report", "--trace-dir", str(tmp_path)]
    torch.set_num_threads(2)
    result = run(*args, "--threads", "1")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == f"threads: 1 (of {available_cores()} cores; set by --threads)"
    assert torch.get_num_threads() == 1

    torch.set_num_threads(3)
    default = run(*args)
    assert default.exit_code == 0, default.output
    cores = available_cores()
    assert torch.get_num_threads() == max(1, cores - 1)
    assert default.stderr.splitlines()[0].startswith(f"threads: {max(1, cores - 1)} (of {cores} core")

    torch.set_num_threads(3)
    quiet = run(*args, "--threads", "1", "--json")  # --json: stdout is the document, stderr stays clean
    assert quiet.exit_code == 0, quiet.output
    assert "threads" not in quiet.stderr and json.loads(quiet.stdout)["usage"]["completion_tokens"] == 2
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=[" ".join(c[:2]) for c in MODEL_COMMANDS])
@pytest.mark.parametrize(("value", "message"), [("0", "--threads must be at least 1, got 0"),
                                                ("-1", "--threads must be at least 1, got -1"),
                                                ("2000", "--threads must be at most 1024, got 2000")])
def test_every_model_command_takes_threads_and_refuses_bad_ones(command, value, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run(*command, "--threads", value)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {message}\n"
