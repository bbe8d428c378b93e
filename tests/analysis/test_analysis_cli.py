"""``compare``, ``tune`` and ``analyze bias`` through the real CLI on the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparseety.analysis.token_diff import first_divergence
from sparseety.cli import app
from sparseety.store import load_trace

PROMPT = "Name three colours and say which one is the sky."


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One ``compare --json`` run (streaming, tiny budget) and the trace directory it wrote to."""
    traces = tmp_path_factory.mktemp("traces")
    result = invoke("compare", "--prompt", PROMPT, "--policy", "streaming", "--budget", "10", "--max-new-tokens", "6",
                    "--trace-dir", str(traces), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), traces


@pytest.mark.model  # runs the real default model (through the command line)
def test_compare_json_contract(compared):
    doc, _ = compared
    assert {"baseline", "sparse", "diff", "fidelity", "quality"} <= set(doc)
    base, sparse = doc["baseline"], doc["sparse"]
    assert base["sparsity"]["policy"] == "dense" and sparse["sparsity"]["policy"] == "streaming"
    assert sparse["sparsity"]["budget"] == 10
    assert set(doc["fidelity"]) >= {"mean_kl", "max_kl", "top1_agreement", "ppl_dense", "ppl_sparse", "kl_per_step"}
    assert len(doc["fidelity"]["kl_per_step"]) == len(base["output_token_ids"])
    assert set(doc["quality"]) == {"exact_match", "rouge_l", "embedding_cosine"}
    assert doc["diff"]["first_divergence"] == first_divergence(base["output_token_ids"], sparse["output_token_ids"])
    assert all({"tag", "baseline_tokens", "sparse_tokens"} <= set(op) for op in doc["diff"]["ops"])
    rebuilt = [t for op in doc["diff"]["ops"] for t in (op["baseline_ids"] if op["tag"] == "equal" else op["sparse_ids"])]
    assert rebuilt == sparse["output_token_ids"]
    assert Path(doc["report_path"]).is_file()  # written by default (no --no-report)


def test_compare_stores_both_runs_with_the_compare_section(compared):
    doc, traces = compared
    stored = load_trace(traces, doc["sparse"]["request_id"])
    section = stored.document["compare"]
    assert section["baseline_request_id"] == doc["baseline"]["request_id"]
    assert section["fidelity"] == doc["fidelity"] and section["diff"]["ratio"] == doc["diff"]["ratio"]
    baseline = load_trace(traces, doc["baseline"]["request_id"])
    assert baseline.document["output_token_ids"] == doc["baseline"]["output_token_ids"]


def test_analyze_bias_on_the_compared_run(compared):
    doc, traces = compared
    result = invoke("analyze", "bias", str(traces), "--request-id", doc["sparse"]["request_id"], "--json")
    assert result.exit_code == 0, result.output
    bias = json.loads(result.stdout)
    kept = doc["sparse"]["sparsity"]["kept_positions_final"]
    total_kept = sum(len(p) for heads in kept.values() for p in heads.values())
    assert bias["slots_kept"] == total_kept == 30 * 3 * 10
    for key in ("by_class", "by_position"):
        assert sum(row["kept"] for row in bias[key].values()) == total_kept
    assert bias["by_position"]["sinks"]["retained_fraction"] == 1.0  # streaming keeps its 4 sinks
    table = invoke("analyze", "bias", str(traces), "--request-id", doc["sparse"]["request_id"])
    assert table.exit_code == 0 and "by token class" in table.stdout and "digits" in table.stdout


@pytest.mark.model  # runs the real default model (through the command line)
def test_compare_human_summary(tmp_path: Path):
    result = invoke("compare", "--prompt", PROMPT, "--policy", "dense", "--max-new-tokens", "3", "--tier", "0")
    assert result.exit_code == 0, result.output
    assert "first divergence none (identical)" in result.stdout
    assert "teacher-forced fidelity" in result.stdout and "top-1 agreement" in result.stdout
    progress = [line.split("]")[0] + "]" for line in result.stderr.splitlines() if "] compare: " in line]
    assert progress == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]  # one line per run on a pipe (quiet with --json)


@pytest.mark.model  # runs the real default model (through the command line)
def test_tune_cli(tmp_path: Path):
    out = tmp_path / "tune.json"
    result = invoke("tune", "--prompt", PROMPT, "--policy", "streaming", "--metric", "top1_agreement",
                    "--threshold", "0.75", "--max-new-tokens", "4", "--min-budget", "6", "--max-budget", "46",
                    "--step", "8", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["kind"] == "tune" and doc["policy"] == "streaming" and doc["threshold"] == 0.75
    grid = [6, 14, 22, 30, 38, 46]
    assert all(p["budget"] in grid and p["meets"] == (p["value"] >= 0.75) for p in doc["curve"])
    answer = doc["answer"]
    assert answer is not None and answer["value"] >= 0.75
    below = [p for p in doc["curve"] if p["budget"] == answer["budget"] - 8]
    assert answer["budget"] == 6 or (below and not below[0]["meets"])


@pytest.mark.model  # runs the real default model (through the command line)
def test_analyze_bias_needs_tier_2(tmp_path: Path):
    run = invoke("run", "--prompt", PROMPT, "--policy", "streaming", "--budget", "10", "--max-new-tokens", "2",
                 "--tier", "1", "--trace-dir", str(tmp_path), "--json")
    assert run.exit_code == 0, run.output
    result = invoke("analyze", "bias", str(tmp_path))
    assert result.exit_code == 2
    assert "error: " in result.stderr and "is tier 1; bias analysis needs tier >= 2" in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["compare", "--prompt", "hi", "--policy", "nope"], "valid policies: dense, streaming"),
    (["compare", "--prompt", "hi", "--policy", "h2o", "--ratio", "1.0"], "ratio must be in [0, 1)"),
    (["compare", "--policy", "h2o", "--budget", "8"], "exactly one of --prompt, --prompt-file or --context-file"),
    (["tune", "--prompt", "hi", "--policy", "h2o", "--metric", "rouge", "--threshold", "0.5"], "unknown metric 'rouge'"),
    (["tune", "--prompt", "hi", "--policy", "h2o", "--metric", "top1_agreement", "--threshold", "1.2"],
     "--threshold for top1_agreement must be >= 0 and <= 1, got 1.2"),
    (["tune", "--prompt", "hi", "--policy", "h2o", "--metric", "mean_kl", "--threshold", "-1"],
     "--threshold for mean_kl must be >= 0, got -1"),
    (["tune", "--prompt", "hi", "--policy", "h2o", "--metric", "passkey", "--threshold", "0.5"],
     "--metric passkey builds its own cases"),
    (["tune", "--policy", "h2o", "--metric", "mean_kl", "--threshold", "0.1"], "exactly one of --prompt"),
    (["tune", "--prompt", "hi", "--policy", "h2o", "--metric", "mean_kl", "--threshold", "0.1", "--step", "0"],
     "--step must be a positive integer"),
    (["analyze", "bias", "/no/such/trace"], "/no/such/trace"),
])
def test_bad_input_is_a_clear_error(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "error: " in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.output
