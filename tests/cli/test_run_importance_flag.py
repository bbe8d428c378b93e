"""``--importance`` and ``extraction.importance``: bad values are refused before the model loads."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.run_file import RunFile


def test_bad_importance_flag_is_one_error_line():
    result = CliRunner().invoke(app, ["run", "--prompt", "hi", "--importance", "grad"])
    assert result.exit_code == 2
    assert "error: --importance must be one of attention, value, output, learned, got 'grad'" in result.stderr


def test_run_file_importance(tmp_path: Path):
    good = tmp_path / "good.yaml"
    good.write_text("extraction:\n  importance: output\n")
    assert RunFile.load(good).flag_values()["extraction.importance"] == (("importance",), "output")
    bad = tmp_path / "bad.yaml"
    bad.write_text("extraction:\n  importance: grad\n")
    result = CliRunner().invoke(app, ["run", "--config", str(bad), "--prompt", "hi"])
    assert result.exit_code == 2 and "extraction.importance" in result.stderr and "line 2" in result.stderr
