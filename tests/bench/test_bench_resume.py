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


@pytest.mark.slow
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


def test_a_changed_policy_file_is_never_reused_on_resume(args: list[str], tmp_path: Path):
    """``--policy-opt kvzap:model=FILE``: the file's contents are in the resume key, so a retrained file
    (same path) is refused on --resume instead of mixing its results with the old file's."""
    import torch

    from sparseety.fingerprint import model_fingerprint
    from sparseety.policies.parts.kvzap_model import Surrogate

    fingerprint = model_fingerprint(build_model("llama"))

    def surrogate(seed: int) -> Surrogate:
        g = torch.Generator().manual_seed(seed)
        return Surrogate(w1=torch.zeros(4, 64, 0), b1=torch.zeros(4, 0), w2=torch.randn(4, 64, 2, generator=g),
                         b2=torch.randn(4, 2, generator=g), model=args[args.index("--model") + 1],
                         model_fingerprint=fingerprint)

    path = surrogate(0).save(tmp_path / "kvzap.safetensors")
    run = [*args[: args.index("--policies")], "--policies", "kvzap", "--ratios", "0.5", "--lengths", "150",
           "--depths", "0.5", "--max-new-tokens", "2", "--policy-opt", f"kvzap:model={path}", "--quiet",
           "--out", str(tmp_path / "bench")]
    first = CliRunner().invoke(app, run)
    assert first.exit_code == 0, first.output
    document = json.loads((tmp_path / "bench" / "passkey.json").read_text())
    assert document["complete"] is True and list(document["run"]["inputs"]) == [str(path)]
    surrogate(1).save(path)
    again = CliRunner().invoke(app, [*run, "--resume"])
    assert again.exit_code == 2 and f"the contents of {path} changed" in again.stderr, again.output


def test_previous_run_compares_the_recorded_contents(tmp_path: Path):
    from sparseety.suites.resume import input_contents, previous_run
    from sparseety.errors import InputError

    text = tmp_path / "a.txt"
    text.write_text("one")
    run = {"texts": [str(text)], "inputs": input_contents([("--text", text)])}
    target = tmp_path / "r.json"
    target.write_text(json.dumps({"kind": "k", "complete": True, "run": run, "results": []}))
    assert previous_run(target, "k", run, resume=True) is not None
    text.write_text("two")
    with pytest.raises(InputError, match=f"the contents of {text} changed"):
        previous_run(target, "k", {"texts": [str(text)], "inputs": input_contents([("--text", text)])}, resume=True)
