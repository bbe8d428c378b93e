"""``sparseety report`` and the report ``run`` writes, through the real CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from report_helpers import png_size
from typer.testing import CliRunner

from sparseety.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_report_of_a_trace_directory_goes_next_to_the_trace(real_trace_dir: Path, real_trace):
    result = invoke("report", str(real_trace_dir))
    assert result.exit_code == 0, result.output
    expected = real_trace_dir / "reports" / f"{real_trace.request_id}.html"
    assert result.stdout.strip() == f"report: {expected}"
    assert real_trace.request_id in expected.read_text()


def test_out_png_layer_and_request_id(real_trace_dir: Path, real_trace, tmp_path: Path):
    out = tmp_path / "r.html"
    result = invoke("report", str(real_trace_dir), "-o", str(out), "--png", str(tmp_path / "png"), "--layer", "7",
                    "--request-id", real_trace.request_id)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"report: {out}"
    figures = [Path(line.removeprefix("figure: ")) for line in lines[1:]]
    assert [f.name for f in figures] == ["importance.png", "timeline.png", "kept_fraction.png"]
    assert all(png_size(f) == (1000, 500) for f in figures)
    assert '"layer":7' in out.read_text()


def test_report_of_a_passkey_file(tmp_path: Path):
    source = tmp_path / "passkey.json"
    source.write_text(json.dumps({"kind": "passkey", "results": [{}], "accuracy": {"h2o": {"0.5": 1.0}},
                                  "by_depth": {"h2o": {"0.5": 1.0}}}))
    result = invoke("report", str(source))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"report: {tmp_path / 'passkey.html'}"


def error_of(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_bad_paths(tmp_path: Path):
    assert "does not exist" in error_of(invoke("report", str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    assert "is not a sparseety trace dataset" in error_of(invoke("report", str(tmp_path / "empty")))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "notes.txt" in error_of(invoke("report", str(text)))
    bad_json = tmp_path / "tune.json"
    bad_json.write_text(json.dumps({"kind": "tune", "curve": "no"}))
    assert "'curve' must be a list" in error_of(invoke("report", str(bad_json)))


def test_bad_layer_and_request_id(real_trace_dir: Path):
    assert error_of(invoke("report", str(real_trace_dir), "--layer", "30")) == \
        "error: --layer 30 does not exist: the trace has layers 0..29"
    assert "nope" in error_of(invoke("report", str(real_trace_dir), "--request-id", "nope"))


@pytest.mark.parametrize(("version", "age"), [("0.3", "older"), ("2.0", "newer")])
def test_trace_of_another_major_schema(real_trace, tmp_path: Path, version: str, age: str):
    """A run stored with another major version in its provenance is refused with a clear error."""
    from sparseety.engine.result import RunResult
    from sparseety.schema import TokenRecord
    from sparseety.store import write_trace

    doc = real_trace.document
    sparsity = doc["sparsity"]
    provenance = copy.deepcopy(doc["provenance"])
    provenance["schema_version"] = version
    result = RunResult(
        request_id="old0schema", model=doc["model"], text=doc["text"], prompt_ids=doc["prompt_token_ids"],
        output_ids=doc["output_token_ids"], policy=sparsity["policy"], params=sparsity["params"],
        budget=sparsity["budget"], tier=doc["tier"], evicted_positions=sparsity["evicted_positions"],
        eviction_events=sparsity["eviction_events"], skipped_events=sparsity["skipped_events"],
        kept_positions_final=sparsity["kept_positions_final"], kv_cache_bytes_peak=sparsity["kv_cache_bytes_peak"],
        kv_cache_bytes_dense=sparsity["kv_cache_bytes_dense"], draft_tokens=0, draft_rejected=0, prefill_s=0.1,
        decode_s=0.1, important_tokens=[TokenRecord.from_dict(r) for r in doc["important_tokens"]],
        token_texts=doc["token_texts"], provenance=provenance, arrays=dict(real_trace.arrays),
    )
    write_trace(result, tmp_path)
    message = error_of(invoke("report", str(tmp_path)))
    assert f"schema version {version}, an {age} major version" in message


@pytest.mark.model  # runs the real default model (through the command line)
def test_run_writes_a_report_unless_told_not_to(tmp_path: Path):
    args = ["run", "--prompt", "Name two colours.", "--policy", "streaming", "--budget", "16",
            "--max-new-tokens", "2", "--trace-dir", str(tmp_path)]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    line = [x for x in result.stdout.splitlines() if x.startswith("report: ")]
    assert len(line) == 1
    report = Path(line[0].removeprefix("report: "))
    assert report.parent == tmp_path / "reports" and report.is_file()
    assert 'data-section="timeline"' in report.read_text()
    quiet = invoke(*args, "--no-report", "--json")
    assert quiet.exit_code == 0, quiet.output
    json.loads(quiet.stdout)
    assert list((tmp_path / "reports").iterdir()) == [report]
