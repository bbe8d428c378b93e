"""``--config FILE`` drives every command: the documented example end to end, flags winning, bad files refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparseety.cli import app

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "run.yaml"
PROMPT = "List three colours of the rainbow and say which one has the longest wavelength, in one sentence."


@pytest.mark.model  # runs the real default model (through the command line)
def test_the_documented_example_drives_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example's output_file is relative
    result = CliRunner().invoke(app, ["run", "--config", str(EXAMPLE), "--prompt", PROMPT, "--max-new-tokens", "4",
                                      "--trace-dir", str(tmp_path / "traces"), "--no-report", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    sparsity = doc["sparsity"]
    assert sparsity["policy"] == "h2o" and sparsity["budget"] == 2048          # sparsity.policy, kv_cache_limit
    assert doc["usage"]["completion_tokens"] <= 4                               # the flag beat model.max_new_tokens
    assert sparsity["pruned_tokens"] > 0 and sparsity["prune"]                 # token_pruning: true
    assert sparsity["skipped_events"] > 0                                       # attention_topk: 16
    assert len(doc["extraction"]["recorded_layers"]) == 1                       # layers: auto
    assert doc["tier"] == 2                                                      # logging.tier
    rows = [json.loads(line) for line in (tmp_path / "token_trace.jsonl").read_text().splitlines()]
    assert {row.get("request_id") for row in rows} == {doc["request_id"]}       # logging.output_file


@pytest.mark.model  # runs the real default model (through the command line)
def test_flags_override_the_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("sparsity: {policy: streaming, kv_cache_limit: 24}\nmodel: {max_new_tokens: 3}\n")
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--prompt", PROMPT, "--budget", "20",
                                      "--tier", "1", "--trace-dir", str(tmp_path / "t"), "--no-report", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["sparsity"]["policy"], doc["sparsity"]["budget"], doc["usage"]["completion_tokens"]) == ("streaming", 20, 3)


@pytest.mark.parametrize("command", [["run", "--prompt", "x"], ["compare", "--prompt", "x"],
                                     ["tune", "--metric", "mean_kl", "--threshold", "0.1", "--prompt", "x"],
                                     ["bench", "passkey"], ["serve"]])
def test_every_command_refuses_a_bad_file_before_loading_the_model(tmp_path, command):
    config = tmp_path / "bad.yaml"
    config.write_text("sparsity:\n  policy: h2o\n  kv_cache_limit: lots\n")
    result = CliRunner().invoke(app, [*command, "--config", str(config)])
    assert result.exit_code == 2
    assert f"error: {config}: sparsity.kv_cache_limit must be a valid integer, got 'lots' (line 3)" in result.stderr


def test_keys_a_command_cannot_use_are_reported_not_dropped(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("logging: {output_file: x.jsonl}\nsparsity: {policy: lru}\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2 and "unknown policy 'lru'" in result.stderr
    config.write_text("logging: {output_file: x.jsonl}\nsparsity: {policy: h2o, kv_cache_limit: 8}\n")
    result = CliRunner().invoke(app, ["tune", "--config", str(config), "--metric", "nope", "--threshold", "1"])
    assert "note: " in result.stderr and "logging.output_file does not apply to `tune`; ignored" in result.stderr
    assert "sparsity.kv_cache_limit does not apply to `tune`; ignored" in result.stderr
    assert result.exit_code == 2 and "error:" in result.stderr
