"""``sparseety run`` end to end: the JSON contract, the trace on disk, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.store import load_trace

RUN_KEYS = {"request_id", "text", "output_token_ids", "usage", "sparsity", "important_tokens", "timings", "trace_path"}
SPARSITY_KEYS = {
    "policy", "params", "budget", "evicted_positions", "eviction_events", "kept_positions_final",
    "kv_cache_bytes_peak", "kv_cache_bytes_dense", "draft_tokens", "draft_rejected",
}
RECORD_KEYS = {"token_id", "position", "score", "layer", "step", "head", "rank", "token_type", "text"}


def invoke(*args: str):
    return CliRunner().invoke(app, ["run", *args])


@pytest.mark.model  # runs the real default model (through the command line)
def test_json_contract_and_trace(tmp_path: Path):
    result = invoke("--prompt", "Name three colours.", "--policy", "streaming", "--budget", "16",
                    "--policy-opt", "sinks=2", "--max-new-tokens", "8", "--trace-dir", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert RUN_KEYS <= set(doc)
    assert SPARSITY_KEYS <= set(doc["sparsity"])
    assert set(doc["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert set(doc["timings"]) == {"prefill_s", "decode_s", "decode_tokens_per_s"}
    assert doc["usage"]["completion_tokens"] == len(doc["output_token_ids"]) == 8
    assert doc["sparsity"]["params"] == {"sinks": 2}
    kept = doc["sparsity"]["kept_positions_final"]
    assert set(kept) == {str(i) for i in range(30)} and set(kept["0"]) == {"0", "1", "2"}
    assert all(len(p) == 16 for heads in kept.values() for p in heads.values())
    assert doc["important_tokens"] and RECORD_KEYS <= set(doc["important_tokens"][0])
    stored = load_trace(doc["trace_path"])
    trace, arrays = stored.document, stored.arrays
    assert trace["request_id"] == doc["request_id"]
    assert trace["provenance"]["policy"] == "streaming" and trace["provenance"]["schema_version"]
    assert trace["provenance"]["torch_version"].startswith("2.13")
    assert len(arrays["evicted.position"]) == doc["sparsity"]["eviction_events"]
    ids = np.asarray(trace["prompt_token_ids"] + doc["output_token_ids"])
    assert (arrays["evicted.token_id"] == ids[arrays["evicted.position"]]).all()


@pytest.mark.model  # runs the real default model (through the command line)
def test_ratio_resolves_budget_from_the_prompt(tmp_path: Path):
    result = invoke("--prompt", "Name three colours and three animals, please.", "--policy", "h2o", "--ratio", "0.5",
                    "--max-new-tokens", "4", "--tier", "1", "--trace-dir", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["sparsity"]["budget"] == int(doc["usage"]["prompt_tokens"] * 0.5)
    assert doc["sparsity"]["kept_positions_final"] is None  # tier 1: counts only


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "hi", "--policy", "nope"], "valid policies: dense, streaming"),
        (["--prompt", "hi", "--policy", "h2o", "--budget", "0"], "budget must be a positive integer"),
        (["--prompt", "hi", "--policy", "streaming", "--budget", "2"], "must be >= sinks"),
        (["--prompt", "hi", "--policy", "h2o", "--ratio", "1.0"], "ratio must be in [0, 1)"),
        (["--prompt", "hi", "--policy", "h2o", "--budget", "8", "--policy-opt", "bogus=1"], "valid options: recent_ratio"),
        (["--prompt", "   ", "--policy", "dense"], "the prompt is empty"),
        (["--prompt", "hi", "--model", "/no/such/model"], "/no/such/model"),
        (["--prompt-file", "/no/such/file.txt"], "cannot read --prompt-file"),
        (["--prompt", "hi", "--policy", "h2o"], "needs --budget N or --ratio R"),
        (["--prompt", "hi", "--context-file", "x.txt", "--question", "q"], "exactly one of"),
    ],
)
@pytest.mark.model  # runs the real default model (through the command line)
def test_bad_input_is_a_clear_error(args: list[str], message: str):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "error: " in result.stderr and message in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.model  # runs the real default model (through the command line)
def test_prompt_longer_than_the_context(tmp_path: Path):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("word " * 9000)
    result = invoke("--prompt-file", str(long_prompt), "--no-chat")
    assert result.exit_code == 2
    assert "exceeds the model's context of 8192 tokens" in result.stderr


def test_readme_main_job_runs():
    """The README's main-job command, exactly as written there."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("bash scripts/setup.sh && "))
    command = line.removeprefix("bash scripts/setup.sh && ")
    venv_bin = Path(sys.executable).parent
    out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parents[2], env={"PATH": f"{venv_bin}:/usr/bin:/bin"} | _keep_env())
    assert out.returncode == 0, out.stderr
    assert "summary" in out.stdout and "KV cache: peak" in out.stdout
    assert "trace: " in out.stdout


def _keep_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in {"HOME", "SPARSEETY_CACHE", "HF_HOME", "TMPDIR"}}


@pytest.mark.model  # runs the real default model (through the command line)
def test_a_long_decode_reports_progress_on_stderr_and_json_stays_quiet(tmp_path: Path):
    args = ["--prompt", "Name three colours.", "--max-new-tokens", "40", "--trace-dir", str(tmp_path), "--no-report"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if "decode (steps of 16 tokens)" in line]
    assert [line.split("]")[0] for line in lines] == ["[1/3", "[2/3", "[3/3"][: len(lines)] and len(lines) >= 2
    quiet = invoke(*args, "--json")
    assert quiet.exit_code == 0 and "decode (steps" not in quiet.stderr


@pytest.mark.model  # runs the real default model (through the command line)
def test_an_over_long_prompt_file_is_refused_by_its_size_before_tokenizing(tmp_path: Path):
    huge = tmp_path / "huge.txt"
    huge.write_text("word " * 400_000)
    result = invoke("--prompt-file", str(huge), "--no-chat", "--trace-dir", str(tmp_path / "t"))
    assert result.exit_code == 2
    assert result.stderr == ("error: --prompt-file is 2000000 bytes, more than the 1048576 bytes the model's context "
                             "of 8192 tokens can hold (128 bytes a token at most); refused before tokenizing\n")
