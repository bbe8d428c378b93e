"""``sparseety bench passkey`` end to end on the real default model (one ~600-token case)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
from typer.testing import CliRunner

from sparseety.suites.passkey import is_correct
from sparseety.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", "passkey", *args])


@pytest.mark.model  # runs the real default model (through the command line)
def test_passkey_bench_writes_json_table_and_plot(tmp_path: Path):
    result = invoke("--policies", "snapkv", "--ratios", "0.5", "--lengths", "600", "--depths", "0.5", "--seed", "0",
                    "--max-new-tokens", "12", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "passkey.json").read_text())
    assert doc["kind"] == "passkey" and doc["model"] == "smollm2-135m" and doc["seed"] == 0
    (case,) = doc["cases"]
    assert case["length"] == 600 and case["depth"] == 0.5 and abs(case["context_tokens"] - 600) < 120
    assert case["needle"] == f"The pass key is {case['passkey']}. Remember it."
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"dense", "snapkv"} and rows["snapkv"]["ratio"] == 0.5
    assert rows["dense"]["correct"], f"dense must find the pass key (sanity row): {rows['dense']['answer']!r}"
    for row in doc["results"]:
        assert row["passkey"] == case["passkey"] and row["correct"] == is_correct(case["passkey"], row["answer"])
        assert {"length", "depth", "kv_cache_bytes_peak", "seconds"} <= set(row)
    assert rows["snapkv"]["kv_cache_bytes_peak"] < rows["dense"]["kv_cache_bytes_peak"]
    assert doc["accuracy"] == {"dense": {"0.0": 1.0}, "snapkv": {"0.5": float(rows["snapkv"]["correct"])}}
    assert doc["by_depth"] == {"dense": {"0.5": 1.0}, "snapkv": {"0.5": float(rows["snapkv"]["correct"])}}
    image = matplotlib.image.imread(tmp_path / "passkey.png")
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400
    assert "accuracy by ratio" in result.stdout and "accuracy by depth" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--ratios", "0.5,1.5"], "--ratios: a ratio must be in [0, 1), got 1.5"),
    (["--depths", "2"], "--depths: 2 is out of range (0 <= depth <= 1)"),
    (["--lengths", "abc"], "--lengths: 'abc' is not a valid int"),
    (["--lengths", "20"], "--lengths: 20 is out of range (50 to 131072 tokens)"),
    (["--policies", "snapkv,nope"], "unknown policy 'nope'"),
    (["--policies", ""], "--policies needs at least one value"),
])
def test_bad_input_is_a_clear_error(args, message, tmp_path: Path):
    result = invoke(*args, "--out", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert f"error: {message}" in result.stderr
    assert not (tmp_path / "passkey.json").exists()
