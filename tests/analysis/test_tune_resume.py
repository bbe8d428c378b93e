"""``tune --out F`` rewrites F after every evaluated budget: a run killed with SIGKILL after its second
budget keeps both, ``--resume`` evaluates only the budgets the bisection still needs, and the answer
equals an uninterrupted run's. Progress is one line per budget off a terminal, none with --json."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_models import build_model, build_tokenizer
from typer.testing import CliRunner

from sparseety.cli import app

KILL_AFTER_SECOND_WRITE = textwrap.dedent("""
    import os, signal, sys
    import sparseety.suites.resume as resume
    from sparseety.cli import app

    real, calls = resume.write_document, [0]

    def write_then_die(path, document):
        real(path, document)
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    resume.write_document = write_then_die
    app(sys.argv[1:])
""")


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    prompt = " ".join(f"t{4 + (i * 7) % 150}" for i in range(40))
    return ["tune", "--model", str(folder), "--policy", "streaming", "--metric", "mean_kl", "--threshold", "0.0001",
            "--prompt", prompt, "--no-chat", "--max-new-tokens", "8"]


@pytest.mark.slow
def test_a_killed_tune_resumes_and_gives_the_same_answer(args: list[str], tmp_path: Path):
    whole = CliRunner().invoke(app, [*args, "--json"])
    assert whole.exit_code == 0, whole.output
    reference = json.loads(whole.stdout)
    assert not [line for line in whole.stderr.splitlines() if line.startswith("[")]  # --json: no progress
    assert len(reference["curve"]) > 3

    out = tmp_path / "tune.json"
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_SECOND_WRITE, *args, "--out", str(out)],
                            capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and len(partial["curve"]) == 2
    assert all(point in reference["curve"] for point in partial["curve"])

    refused = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert refused.exit_code == 2 and "pass --resume" in refused.stderr
    resumed = CliRunner().invoke(app, [*args, "--out", str(out), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    lines = [line for line in resumed.stderr.splitlines() if line.startswith("[")]
    assert len(lines) == len(reference["curve"]) - 2  # the two kept budgets are not evaluated again
    assert lines[0].startswith("[3/") and "budget" in lines[0]
    done = json.loads(out.read_text())
    assert done["complete"] is True
    assert done["curve"] == reference["curve"] and done["answer"] == reference["answer"]


def test_resume_needs_out(args: list[str]):
    result = CliRunner().invoke(app, [*args, "--resume"])
    assert result.exit_code == 2 and "give --out FILE" in result.stderr
