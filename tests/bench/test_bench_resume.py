"""``bench passkey`` keeps what it did: a run killed with SIGKILL leaves every finished case in
passkey.json, ``--resume`` finishes the rest without redoing them, and settings that differ, or a
fresh start over an unfinished run, are refused. Progress is one line per case off a terminal."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from killed_bench import SPARSEETY, kill_after_first_case
from tiny_models import build_model, build_tokenizer
from typer.testing import CliRunner

from sparseety.cli import app

TOTAL = 2 * (1 + 3)  # two lengths, dense plus three ratios


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> list[str]:
    """The bench on a tiny model saved as a Hugging Face directory (any directory works as --model)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return ["bench", "passkey", "--model", str(folder), "--policies", "streaming", "--ratios", "0.25,0.5,0.75",
            "--lengths", "150,200", "--depths", "0.5", "--max-new-tokens", "4"]


def test_a_killed_bench_resumes_without_redoing_cases(args: list[str], tmp_path: Path):
    out = tmp_path / "bench"
    kept = kill_after_first_case(args, out, "--out", "passkey.json", TOTAL, "passkey")

    fresh = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert fresh.exit_code == 2 and "pass --resume" in fresh.stderr  # finished cases are never overwritten silently
    other = CliRunner().invoke(app, [*args[:-1], "7", "--out", str(out), "--resume"])
    assert other.exit_code == 2 and "max_new_tokens differ" in other.stderr

    resumed = subprocess.run([SPARSEETY, *args, "--out", str(out), "--resume"], capture_output=True, text=True,
                             check=True)
    lines = [line for line in resumed.stderr.splitlines() if line.startswith("[")]
    assert len(lines) == TOTAL - len(kept)  # only the cases not finished before the kill
    assert lines[0].startswith(f"[{len(kept) + 1}/{TOTAL}]") and lines[-1].startswith(f"[{TOTAL}/{TOTAL}]")
    done = json.loads((out / "passkey.json").read_text())
    assert done["complete"] is True and len(done["results"]) == TOTAL
    assert done["results"][: len(kept)] == kept  # the finished cases kept as they were
    assert len({(r["policy"], r["ratio"], r["length"]) for r in done["results"]}) == TOTAL
    assert (out / "passkey.png").is_file()
    assert CliRunner().invoke(app, [*args[:-1], "x", "--out", str(out)]).exit_code == 2
