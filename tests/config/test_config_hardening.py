"""Configuration files: a key given twice is refused naming both lines; every bad value names its key
path and line (never a command-line flag); a policy that never evicts cannot be tuned; ``export -o``
creates missing folders as ``report -o`` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.config import ExtractionConfig
from sparseety.errors import ConfigError
from sparseety.run_file import RunFile
from sparseety.store import write_trace
from sparseety.store.synthetic import synthetic_result


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_a_duplicate_key_is_refused_naming_both_lines(tmp_path: Path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("model:\n  max_new_tokens: 4\nsparsity:\n  policy: h2o\n  policy: streaming\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'policy' at line 5 \(first given at line 4\)"):
        RunFile.load(run_file)
    extraction = tmp_path / "extract.yaml"
    extraction.write_text("top_k: 3\nmin_score: 0.1\ntop_k: 5\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'top_k' at line 3 \(first given at line 1\)"):
        ExtractionConfig.from_yaml(extraction)
    top = tmp_path / "top.yaml"
    top.write_text("logging:\n  tier: 1\nlogging:\n  tier: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'logging' at line 3"):
        RunFile.load(top)


BAD_VALUES = {
    "extraction.layers": ("extraction:\n  top_k: 4\n  layers: '0,x'\n", 3, "is not a layer number"),
    "extraction.layers twice": ("extraction:\n  layers: [1, 1]\n", 2, "listed twice"),
    "sparsity.token_pruning": ("sparsity:\n  policy: h2o\n  token_pruning: '8-0.3'\n", 3, "is not layer:fraction"),
    "sparsity.policy_opts": ("sparsity:\n  policy: h2o\n  policy_opts:\n    nope: 1\n", 3, "has no option 'nope'"),
    "sparsity.policy_opts value": ("sparsity:\n  policy: h2o\n  policy_opts:\n    recent_ratio: 7\n", 3, "recent_ratio"),
    "sparsity.policy_opts type": ("sparsity:\n  policy: kvzap\n  policy_opts:\n    model: 5\n", 3,
                                  "kvzap: option model must be text (a string), got int 5"),
    "sparsity.policy_opts infinity": ("sparsity:\n  policy: h2o\n  policy_opts:\n    recent_ratio: .inf\n", 3,
                                      "h2o: option recent_ratio must be a finite number, got inf"),
    "logging.output_file": ("logging:\n  output_file: {folder}\n", 2, "is a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_every_bad_value_names_its_key_path_and_line(case: str, tmp_path: Path):
    text, line, message = BAD_VALUES[case]
    path = tmp_path / "run.yaml"
    path.write_text(text.format(folder=tmp_path))
    with pytest.raises(ConfigError) as caught:
        RunFile.load(path)
    error = str(caught.value)
    key = case.split()[0]
    assert f"{key}: " in error and f"(line {line})" in error and message in error, error
    assert "--" not in error.replace(str(tmp_path), "")  # no command-line flag named
    result = cli("tune", "--config", path, "--policy", "h2o", "--metric", "mean_kl", "--threshold", "0.1",
                 "--prompt", "hi")
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and key in result.stderr
    assert "Traceback" not in result.stderr


def test_extraction_config_errors_name_the_line(tmp_path: Path):
    path = tmp_path / "extract.yaml"
    path.write_text("normalize: max\ntop_k: 0\n")
    with pytest.raises(ConfigError, match=r"top_k must be greater than 0, got 0 \(line 2\)"):
        ExtractionConfig.from_yaml(path)


@pytest.mark.parametrize("policy", ["dense", "topk_attention"])
def test_tune_refuses_a_policy_that_never_evicts(policy: str):
    result = cli("tune", "--policy", policy, "--metric", "top1_agreement", "--threshold", "0.9", "--prompt", "hi")
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    assert f"policy {policy!r} never evicts" in result.stderr and "streaming" in result.stderr


def test_tune_refuses_a_threshold_policy_for_the_real_reason():
    result = cli("tune", "--policy", "kvzap", "--policy-opt", "threshold=-3", "--metric", "top1_agreement",
                 "--threshold", "0.9", "--prompt", "hi")
    assert result.exit_code == 2 and result.stderr.startswith("error: "), result.output
    assert "tune searches the budget" in result.stderr and "threshold=-3" in result.stderr
    assert "not both" not in result.stderr


def test_tune_library_refuses_it_too():
    from sparseety.analysis.tune import check_tunable

    with pytest.raises(ConfigError, match="never evicts"):
        check_tunable("dense")
    check_tunable("h2o")


def test_export_creates_missing_folders_like_report(tmp_path: Path):
    write_trace(synthetic_result(0), tmp_path / "traces")
    out = tmp_path / "new" / "deeper" / "all.jsonl"
    result = cli("export", "--trace-dir", tmp_path / "traces", "-o", out)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text().splitlines()[0])["table"]
    report = cli("report", tmp_path / "traces", "-o", tmp_path / "other" / "r.html")
    assert report.exit_code == 0 and (tmp_path / "other" / "r.html").is_file()
    into_dir = cli("export", "--trace-dir", tmp_path / "traces", "-o", tmp_path / "new")
    assert into_dir.exit_code == 2 and "is a directory" in into_dir.stderr
