"""Run configuration files: validation with key paths and lines, mapping onto flags, flags winning."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from sparseety.errors import ConfigError
from sparseety.run_file import RunFile, with_run_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "run.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_the_documented_example_maps_onto_flags():
    values = {key: value for key, (_, value) in RunFile.load(EXAMPLE).flag_values(num_layers=30).items()}
    assert values["model.path"] == "smollm2-135m"
    assert values["model.max_new_tokens"] == 128
    assert values["sparsity.policy"] == "h2o"
    assert values["sparsity.kv_cache_limit"] == 2048
    assert values["sparsity.attention_topk"] == 16
    assert values["sparsity.token_pruning"] == "6:0.3,14:0.5"
    assert RunFile.load(EXAMPLE).flag_values()["sparsity.token_pruning"][1] == "default"
    assert values["extraction.layers"] == "auto"
    assert values["logging.output_file"] == "token_trace.jsonl"


def test_an_empty_file_sets_nothing(tmp_path):
    assert RunFile.load(_write(tmp_path, "")).flag_values() == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sparsity:\n  policy: h2o\n  kv_cach_limit: 8\n", "unknown key 'sparsity.kv_cach_limit' (line 3); known keys here: enabled, policy"),
        ("modle: {}\n", "unknown key 'modle' (line 1); known keys here: model, sparsity, extraction, logging"),
        ("sparsity:\n  kv_cache_limit: many\n", "sparsity.kv_cache_limit must be a valid integer, got 'many' (line 2)"),
        ("sparsity:\n  kv_cache_limit: -4\n", "sparsity.kv_cache_limit must be greater than 0, got -4 (line 2)"),
        ("logging:\n  tier: 7\n", "logging.tier must be less than or equal to 3, got 7 (line 2)"),
        ("sparsity:\n  policy: lru\n", "sparsity.policy: unknown policy 'lru'"),
        ("sparsity:\n  kv_cache_limit: 8\n  ratio: 0.5\n", "kv_cache_limit and sparsity.ratio both set"),
        ("sparsity:\n  enabled: false\n  policy: h2o\n", "sparsity.enabled is false but sparsity.policy is set"),
        ("sparsity:\n  policy: topk_attention\n  kv_cache_limit: 8\n  attention_topk: 4\n", "contradicts it"),
        ("- a\n- b\n", "holds one mapping of sections, got list"),
        ("model: [\n", "cannot read config"),
    ],
)
def test_bad_files_name_the_key_and_line(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        RunFile.load(_write(tmp_path, text))
    assert expected in str(info.value)
    assert str(tmp_path / "run.yaml") in str(info.value)


def test_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        RunFile.load(tmp_path / "nope.yaml")


def test_token_pruning_true_scales_with_depth():
    file = RunFile(sparsity={"token_pruning": True})
    assert file.prune_schedule(num_layers=16) == "3:0.3,7:0.5"
    from sparseety.prune_schedule import parse_prune_schedule

    assert parse_prune_schedule("default", num_layers=16) == parse_prune_schedule("3:0.3,7:0.5")
    assert RunFile(sparsity={"token_pruning": "8:0.3"}).prune_schedule() == "8:0.3"
    assert RunFile(sparsity={"enabled": False}).flag_values() == {"sparsity.enabled": (("policy",), "dense")}


def _probe_app():
    app = typer.Typer()

    @app.command()
    @with_run_file
    def go(
        ctx: typer.Context,
        config: Path | None = typer.Option(None, "--config"),
        policy: str = typer.Option("dense", "--policy"),
        budget: int | None = typer.Option(None, "--budget"),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    ) -> None:
        print(f"{policy} {budget} {max_new_tokens}")

    return app


def test_flags_given_on_the_command_line_win_over_the_file(tmp_path):
    path = _write(tmp_path, "model: {max_new_tokens: 12}\nsparsity: {policy: h2o, kv_cache_limit: 32}\nextraction: {top_k: 4}\n")
    runner = CliRunner()
    result = runner.invoke(_probe_app(), ["--config", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "h2o 32 12"
    assert "extraction.top_k does not apply to `go`; ignored" in result.stderr
    result = runner.invoke(_probe_app(), ["--config", str(path), "--budget", "8", "--policy", "dense"])
    assert result.stdout.splitlines()[-1] == "dense 8 12"
    # A flag given with its default value is still given: it wins.
    result = runner.invoke(_probe_app(), ["--config", str(path), "--max-new-tokens", "64"])
    assert result.stdout.splitlines()[-1] == "h2o 32 64"
