"""Small things that confused: ``traces list`` never cuts a request id whatever the terminal width,
``traces show`` names the all-layers ranking ``all`` (not ``None``), ranks start at 0 everywhere."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.store import write_trace
from sparseety.store.synthetic import synthetic_result

LONG_IDS = [f"tenant-{i}-" + "0123456789abcdef" * 4 for i in range(3)]


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    for i, request_id in enumerate(LONG_IDS):
        result = synthetic_result(i, tier=2)
        overall = [replace(r, layer=None) for r in result.important_tokens if r.layer == 0]  # the all-layers ranking
        write_trace(replace(result, request_id=request_id, important_tokens=overall + result.important_tokens), tmp_path)
    return tmp_path


@pytest.mark.parametrize("columns", ["40", "80", "200"])
def test_traces_list_never_cuts_an_id(dataset: Path, columns: str):
    result = CliRunner().invoke(app, ["traces", "list", "--trace-dir", str(dataset)], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    for request_id in LONG_IDS:
        assert request_id in result.stdout  # whole, on one line, copyable
    assert "…" not in result.stdout.split("\n")[3]


def test_traces_show_names_the_all_layers_ranking(dataset: Path):
    result = CliRunner().invoke(app, ["traces", "show", LONG_IDS[0], "--trace-dir", str(dataset)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "None" not in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ all ")]
    assert rows, result.stdout
    stored = json.loads(CliRunner().invoke(app, ["traces", "show", LONG_IDS[0], "--trace-dir", str(dataset),
                                                 "--json"]).stdout)
    ranks = sorted(r["rank"] for r in stored["important_tokens"] if r["layer"] is None)
    assert ranks[0] == 0  # the same convention in the JSON, the table and the report
    assert rows[0].split("│")[2].strip() == "0"


def test_the_report_shows_ranks_from_zero_and_normalised_scores():
    from importlib.resources import files

    script = (files("sparseety.report") / "templates" / "report.js").read_text()
    assert "rank + 1" not in script and "+ 1}`" not in script.replace("layer + 1", "")
    assert "s / layerMax" in script and "1 = the highest score" in script
