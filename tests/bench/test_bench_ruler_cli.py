"""``sparseety bench ruler`` end to end: one tiny case on the real default model (JSON, PNG, report page,
tables), clear errors for bad flags, and resume after a kill on a tiny model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import matplotlib.image
import pytest
from killed_bench import SPARSEETY, kill_after_first_case
from tiny_models import build_model, build_tokenizer
from typer.testing import CliRunner

from sparseety.suites.ruler import score
from sparseety.cli import app



def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", "ruler", *args])


def test_ruler_bench_writes_json_plot_and_report_on_the_default_model(tmp_path: Path, smollm):
    result = invoke("--tasks", "niah_single", "--lengths", "300", "--cases", "1", "--policies", "streaming",
                    "--ratios", "0.5", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "ruler.json").read_text())
    assert doc["kind"] == "ruler" and doc["complete"] is True and doc["model"] == "smollm2-135m"
    assert doc["tasks"] == ["niah_single"] and doc["run"]["cases"] == 1
    (case,) = doc["cases"]
    assert case["task"] == "niah_single" and abs(case["context_tokens"] - 300) < 60
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"dense", "streaming"} and rows["streaming"]["ratio"] == 0.5
    assert rows["dense"]["score"] == 1.0, f"dense must find the needle (sanity row): {rows['dense']['answer']!r}"
    for row in doc["results"]:
        assert row["expected"] == case["expected"] and row["score"] == score(row["expected"], row["answer"])
    assert rows["streaming"]["kv_cache_bytes_peak"] < rows["dense"]["kv_cache_bytes_peak"]
    assert doc["by_task"] == {"niah_single": {"dense": {"0.0": 1.0}, "streaming": {"0.5": rows["streaming"]["score"]}}}
    assert doc["accuracy"] == doc["by_task"]["niah_single"]
    image = matplotlib.image.imread(tmp_path / "ruler.png")
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400
    page = (tmp_path / "ruler.html").read_text()
    assert "RULER-style tasks" in page and "niah_single: recall by policy and ratio" in page
    assert "niah_single: recall" in result.stdout and "all tasks: recall" in result.stdout


def test_json_flag_prints_the_document_only(tmp_path: Path):
    folder = tmp_path / "tiny"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    result = invoke("--model", str(folder), "--tasks", "vt", "--lengths", "250", "--cases", "1", "--policies",
                    "keydiff" if _registered("keydiff") else "streaming", "--ratios", "0.5", "--max-new-tokens", "3",
                    "--json", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "ruler" and len(doc["results"]) == 2 and result.stderr == ""


def _registered(name: str) -> bool:
    from sparseety.policies import list_policies

    return name in {cls.name for cls in list_policies()}


@pytest.mark.parametrize(("args", "message"), [
    (["--tasks", "niah_single,qa"], "--tasks: unknown task 'qa'; valid tasks: niah_single, niah_multikey, "
                                    "niah_multivalue, vt, cwe"),
    (["--tasks", "vt,vt"], "--tasks: vt is listed twice in 'vt,vt'; give each value once"),
    (["--tasks", ""], "--tasks needs at least one value"),
    (["--lengths", "100"], "--lengths: 100 is out of range (200 to 131072 tokens)"),
    (["--lengths", "1k"], "--lengths: '1k' is not a valid int"),
    (["--ratios", "1.0"], "--ratios: a ratio must be in [0, 1), got 1.0"),
    (["--cases", "0"], "--cases must be positive, got 0"),
    (["--cases", "100000"], "--cases must be at most 10000, got 100000"),
    (["--policies", "streaming,nope"], "unknown policy 'nope'"),
    (["--policy-opt", "nope:x=1"], "--policy-opt 'nope:x=1' names policy 'nope', which is not in --policies"),
    (["--policy-opt", "streaming:bogus=1"], "streaming: unknown option 'bogus'"),
])
def test_bad_input_is_a_clear_error(args, message, tmp_path: Path):
    result = invoke(*args, "-o", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert f"error: {message}" in result.stderr
    assert not (tmp_path / "ruler.json").exists()


@pytest.mark.slow
def test_a_killed_ruler_bench_resumes_without_redoing_cases(tmp_path: Path):
    folder = tmp_path / "tiny"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    args = ["bench", "ruler", "--model", str(folder), "--tasks", "niah_single,cwe", "--lengths", "250",
            "--cases", "2", "--policies", "streaming", "--ratios", "0.25,0.5", "--max-new-tokens", "4"]
    total = 2 * 2 * 3  # two tasks x two cases x (dense + two ratios)
    out = tmp_path / "bench"
    kept = kill_after_first_case(args, out, "-o", "ruler.json", total, "ruler")

    fresh = CliRunner().invoke(app, [*args, "-o", str(out)])
    assert fresh.exit_code == 2 and "pass --resume" in fresh.stderr
    other = CliRunner().invoke(app, [*args[:-1], "7", "-o", str(out), "--resume"])
    assert other.exit_code == 2 and "max_new_tokens differ" in other.stderr

    resumed = subprocess.run([SPARSEETY, *args, "-o", str(out), "--resume"], capture_output=True, text=True, check=True)
    lines = [line for line in resumed.stderr.splitlines() if line.startswith("[")]
    assert len(lines) == total - len(kept)
    assert lines[0].startswith(f"[{len(kept) + 1}/{total}]") and lines[-1].startswith(f"[{total}/{total}]")
    done = json.loads((out / "ruler.json").read_text())
    assert done["complete"] is True and len(done["results"]) == total
    assert done["results"][: len(kept)] == kept
    assert len({(r["policy"], r["ratio"], r["task"], r["index"]) for r in done["results"]}) == total
    assert (out / "ruler.png").is_file() and (out / "ruler.html").is_file()
