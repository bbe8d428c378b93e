"""The store's commands end to end (typer's CliRunner on the real app): query, traces, export, gc,
replay, and run's storage flags; bad input gives one `error:` line and exit code 2."""

from __future__ import annotations

import csv
import io
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from tiny_models import prompt_ids
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.engine import EncodedInput
from sparseety.policies import build_policy
from sparseety.store import connect, load_trace, write_trace
from sparseety.store.synthetic import synthetic_result


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_bad_input(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, list]:
    results = [synthetic_result(i, tier=2 + (i == 2)) for i in range(3)]
    for result in results:
        write_trace(result, tmp_path)
    return tmp_path, results


def test_query_formats(dataset):
    root, results = dataset
    sql = "SELECT request_id, eviction_events, tier FROM requests ORDER BY request_id"
    expected = sorted((r.request_id, r.eviction_events, r.tier) for r in results)
    as_json = cli("query", sql, "--trace-dir", root, "--format", "json")
    assert as_json.exit_code == 0, as_json.output
    assert [tuple(row.values()) for row in json.loads(as_json.stdout)] == expected
    as_csv = cli("query", sql, "--trace-dir", root, "--format", "csv")
    rows = list(csv.reader(io.StringIO(as_csv.stdout)))
    assert rows[0] == ["request_id", "eviction_events", "tier"]
    assert [(r[0], int(r[1]), int(r[2])) for r in rows[1:]] == expected
    table = cli("query", "SELECT event, count(*) AS n FROM token_events GROUP BY event", "--trace-dir", root)
    assert table.exit_code == 0 and "evicted" in table.stdout
    assert str(sum(r.eviction_events for r in results)) in table.stdout


def test_query_bad_input(dataset, tmp_path: Path):
    root, _ = dataset
    assert_bad_input(cli("query", "SELEC 1", "--trace-dir", root), "malformed SQL")
    assert_bad_input(cli("query", "SELECT * FROM tokens", "--trace-dir", root), "tokens does not exist")
    assert_bad_input(cli("query", "SELECT nope FROM requests", "--trace-dir", root), "query failed")
    assert_bad_input(cli("query", "SELECT 1", "--trace-dir", tmp_path / "missing"), "does not exist")
    (tmp_path / "plain").mkdir()
    assert_bad_input(cli("query", "SELECT 1", "--trace-dir", tmp_path / "plain"), "not a sparseety trace dataset")
    assert_bad_input(cli("query", "SELECT 1", "--trace-dir", root, "--format", "xml"), "--format")


def test_traces_list_and_show(dataset):
    root, results = dataset
    listed = cli("traces", "list", "--trace-dir", root, "--json")
    assert listed.exit_code == 0, listed.output
    assert {json.loads(line)["request_id"] for line in listed.stdout.splitlines()} == {r.request_id for r in results}
    shown = cli("traces", "show", results[2].request_id, "--trace-dir", root, "--json")
    doc = json.loads(shown.stdout)
    assert doc["request_id"] == results[2].request_id and doc["tier"] == 3
    assert doc["arrays"]["step_importance"] == list(results[2].arrays["step_importance"].shape)
    pretty = cli("traces", "show", results[0].request_id, "--trace-dir", root)
    assert pretty.exit_code == 0 and "important tokens" in pretty.stdout and "evicted.position" in pretty.stdout
    assert_bad_input(cli("traces", "show", "no-such-id", "--trace-dir", root), "no request with id 'no-such-id'")


def test_export_jsonl(dataset, tmp_path: Path):
    root, results = dataset
    out = tmp_path / "export.jsonl"
    done = cli("export", "--format", "jsonl", "--trace-dir", root, "-o", out)
    assert done.exit_code == 0, done.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    con = connect(root)
    for table in ("requests", "token_events", "important_tokens", "signals"):
        (count,) = con.sql(f"SELECT count(*) FROM {table}").fetchall()[0]
        assert sum(line["table"] == table for line in lines) == count
    one = cli("export", "--trace-dir", root, "--request-id", results[1].request_id, "--table", "important_tokens")
    rows = [json.loads(line) for line in one.stdout.splitlines()]
    assert [(r["position"], r["rank"]) for r in rows] == [(t.position, t.rank) for t in results[1].important_tokens]
    assert_bad_input(cli("export", "--format", "parquet", "--trace-dir", root), "--format must be jsonl")
    assert_bad_input(cli("export", "--trace-dir", root, "--table", "nope"), "unknown table 'nope'")


def test_gc_deletes_old_partitions_only(tmp_path: Path):
    now = datetime.now(UTC)
    old = [synthetic_result(i) for i in range(2)]
    new = synthetic_result(9)
    write_trace(old[0], tmp_path, created_at=now - timedelta(days=10))
    write_trace(old[1], tmp_path, created_at=now - timedelta(days=9))
    write_trace(new, tmp_path, created_at=now)
    today = next((tmp_path / "signals").glob(f"date={now.date().isoformat()}"))
    stale, fresh = today / ".part-dead.parquet.tmp", today / ".part-live.parquet.tmp"
    for temp in (stale, fresh):
        temp.write_bytes(b"torn")
    os.utime(stale, (now.timestamp() - 7200, now.timestamp() - 7200))  # left by a writer killed 2 h ago
    dry = cli("gc", "--older-than", "7d", "--trace-dir", tmp_path, "--dry-run")
    assert dry.exit_code == 0 and "would delete 8 partition(s)" in dry.stdout
    assert f"would delete stale temporary file {stale}" in dry.stdout and stale.exists()
    assert connect(tmp_path).sql("SELECT count(*) FROM requests").fetchall() == [(3,)]
    done = cli("gc", "--older-than", "1w", "--trace-dir", tmp_path)
    assert done.exit_code == 0 and "deleted 8 partition(s)" in done.stdout
    assert not stale.exists() and fresh.exists()  # a temporary file being written now is left alone
    con = connect(tmp_path)
    assert con.sql("SELECT request_id FROM requests").fetchall() == [(new.request_id,)]
    assert con.sql("SELECT DISTINCT request_id FROM token_events").fetchall() == [(new.request_id,)]
    assert_bad_input(cli("gc", "--older-than", "7 days", "--trace-dir", tmp_path), "retention period")
    assert_bad_input(cli("gc", "--older-than", "7d", "--trace-dir", tmp_path / "missing"), "does not exist")


def offline_records(result, folder: Path) -> Path:
    """The run's step_importance as offline records (one per layer), built from the run itself."""
    steps = result.arrays["step_importance"]
    ids = result.prompt_ids + result.output_ids
    width = steps.shape[2]
    lines = []
    for layer in range(steps.shape[1]):
        np.save(folder / f"l{layer}.npy", np.nan_to_num(steps[:, layer, :].astype(np.float32), nan=0.0))
        lines.append(json.dumps({
            "generation_id": result.request_id, "prompt_tokens": result.prompt_ids,
            "generated_tokens": ids[len(result.prompt_ids):width], "layer": layer, "score_type": "attention",
            "scores_path": f"l{layer}.npy", "layout": "qk"}))
    path = folder / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("flags", [[], ["--top-k", "3", "--query-reduce", "last", "--normalize", "l1"],
                                   ["--layer", "2", "--format", "table", "--min-score", "0.2"], ["--stats"]])
def test_replay_prints_what_extract_prints(flags, tiny_engine, one_torch_thread, tmp_path: Path):
    result = tiny_engine("llama").generate(EncodedInput(prompt_ids(14)), build_policy("h2o", 8), max_new_tokens=5,
                                           tier=3)
    write_trace(result, tmp_path / "traces")
    (tmp_path / "records").mkdir()
    records = offline_records(result, tmp_path / "records")
    extract_flags = [f for f in flags if f not in ("--layer", "2")] if "--layer" in flags else flags
    extracted = cli("extract", records, *extract_flags)
    replayed = cli("replay", "--trace-dir", tmp_path / "traces", "--request-id", result.request_id, *flags)
    assert extracted.exit_code == 0 and replayed.exit_code == 0, (extracted.output, replayed.output)
    if "--layer" in flags:
        kept = [line for line in extracted.stdout.split("\n\n") if "layer 2" in line]
        assert replayed.stdout.strip() and replayed.stdout.strip() in extracted.stdout
        assert kept
    else:
        assert replayed.stdout == extracted.stdout
        assert replayed.stdout.strip()


def test_replay_needs_tier3(dataset):
    root, results = dataset
    assert_bad_input(cli("replay", "--trace-dir", root, "--request-id", results[0].request_id),
                     "replay needs tier-3 signals")
    assert_bad_input(cli("replay", "--trace-dir", root, "--request-id", results[2].request_id, "--layer", "7"),
                     "no attention signal for layer 7")
    assert_bad_input(cli("replay", "--trace-dir", root, "--request-id", "missing"), "no request with id 'missing'")
    assert_bad_input(cli("replay", "--trace-dir", root, "--top-k", "0"), "top_k")


@pytest.mark.model  # runs the real default model (through the command line)
def test_run_force_trace_redact_and_sampling(tmp_path: Path):
    prompt = "Reply to bob@example.org about the invoice."
    forced = cli("run", "--prompt", prompt, "--max-new-tokens", "3", "--trace-dir", tmp_path, "--sample-rate", "0",
                 "--force-trace", "--redact", "--no-report", "--json")
    assert forced.exit_code == 0, forced.output
    doc = json.loads(forced.stdout)
    trace = load_trace(doc["trace_path"])
    assert trace.request_id == doc["request_id"] and trace.tier == 3 and "step_importance" in trace.arrays
    assert "[EMAIL]" in "".join(trace.document["token_texts"]) and "bob@" not in "".join(trace.document["token_texts"])
    unsampled = cli("run", "--prompt", prompt, "--max-new-tokens", "2", "--trace-dir", tmp_path, "--sample-rate", "0",
                    "--ids-only", "--no-report", "--json")
    assert unsampled.exit_code == 0, unsampled.output
    stored = load_trace(tmp_path, json.loads(unsampled.stdout)["request_id"])
    assert stored.tier == 1 and stored.arrays == {} and stored.document["text"] is None
    assert_bad_input(cli("run", "--prompt", "x", "--sample-rate", "1.5", "--trace-dir", tmp_path), "sample rate")


def test_replay_route_signals_from_a_config(tiny_engine, one_torch_thread, tmp_path: Path):
    """MoE router probabilities replay as route records; score_type and experts_k come from --config."""
    result = tiny_engine("qwen2_moe").generate(EncodedInput(prompt_ids(10)), build_policy("dense"), max_new_tokens=3,
                                               tier=3)
    write_trace(result, tmp_path / "traces")
    config = tmp_path / "route.yaml"
    config.write_text("score_type: route\nexperts_k: 1\ntop_k: 4\n")
    ids = result.prompt_ids + result.output_ids
    lines = []
    for name, probs in sorted(result.arrays.items()):
        if name.startswith("router."):
            layer = int(name.split(".")[1])
            np.save(tmp_path / f"r{layer}.npy", probs.astype(np.float32))
            lines.append(json.dumps({"generation_id": result.request_id, "prompt_tokens": result.prompt_ids,
                                     "generated_tokens": ids[len(result.prompt_ids):probs.shape[0]], "layer": layer,
                                     "score_type": "route", "scores_path": f"r{layer}.npy"}))
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    extracted = cli("extract", tmp_path / "records.jsonl", "--config", config)
    replayed = cli("replay", "--trace-dir", tmp_path / "traces", "--config", config)
    assert extracted.exit_code == 0 and replayed.exit_code == 0, (extracted.output, replayed.output)
    assert replayed.stdout == extracted.stdout and '"experts": [[' in replayed.stdout
