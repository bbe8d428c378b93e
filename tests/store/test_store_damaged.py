"""Damaged and foreign files in a trace dataset: every reader skips them with one warning line each and
serves every other row; ``traces check`` lists damaged, orphaned and abandoned files and ``--repair``
quarantines them; the server names skipped files in a response header."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.store import connect, list_traces, load_trace, write_trace
from sparseety.store.health import check_dataset
from sparseety.store.notices import collected
from sparseety.store.synthetic import synthetic_result


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def file_of(root: Path, table: str, request_id: str) -> Path:
    for path in sorted((root / table).rglob("part-*.parquet")):
        if request_id in pq.read_table(path, columns=["request_id"]).column("request_id").to_pylist():
            return path
    raise AssertionError(f"no {table} file holds {request_id}")


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, list[str], list[Path]]:
    """Four requests; request 1's token_events file truncated, request 2's signals file garbage,
    request 3's requests file replaced by a foreign (valid, non-sparseety) Parquet file."""
    ids = []
    for i in range(4):
        result = synthetic_result(i, tier=3)
        write_trace(result, tmp_path)
        ids.append(result.request_id)
    torn = file_of(tmp_path, "token_events", ids[1])
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    garbage = file_of(tmp_path, "signals", ids[2])
    garbage.write_bytes(os.urandom(300))
    foreign = file_of(tmp_path, "requests", ids[3])
    pq.write_table(pa.table({"x": [1, 2, 3]}), foreign)
    return tmp_path, ids, [torn, garbage, foreign]


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: skipped damaged file")]


def assert_warned(result, bad: list[Path]) -> None:
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.stderr
    lines = warning_lines(result.stderr)
    assert len(lines) == len(bad), result.stderr  # one line per damaged file, however often it is read
    for path in bad:
        assert sum(str(path) in line for line in lines) == 1


def test_library_readers_skip_damaged_files(damaged):
    root, ids, bad = damaged
    with collected() as notes:
        con = connect(root)
        stored = {r[0] for r in con.sql("SELECT request_id FROM requests").fetchall()}
        events = {r[0] for r in con.sql("SELECT DISTINCT request_id FROM token_events").fetchall()}
        listed = [row["request_id"] for row in list_traces(root, limit=10)]
        trace = load_trace(root, ids[0])
    assert stored == set(ids[:3]) and set(listed) == set(ids[:3])  # the foreign requests file is skipped
    assert events == {ids[0], ids[2], ids[3]}  # request 1's torn events file is skipped, the rest served
    assert trace.arrays["step_importance"].shape[0] > 0
    assert len(notes) == 3 and all(any(str(p) in n for n in notes) for p in bad)


def test_every_cli_reader_warns_once_per_file_and_serves_the_rest(damaged, tmp_path_factory):
    root, ids, bad = damaged
    listed = cli("traces", "list", "--trace-dir", root, "--json")
    assert_warned(listed, bad)
    assert {json.loads(line)["request_id"] for line in listed.stdout.splitlines()} == set(ids[:3])
    shown = cli("traces", "show", ids[0], "--trace-dir", root, "--json")
    assert_warned(shown, bad)
    assert json.loads(shown.stdout)["request_id"] == ids[0]
    query = cli("query", "SELECT count(DISTINCT request_id) AS n FROM token_events", "--trace-dir", root,
                "--format", "json")
    assert_warned(query, bad)
    assert json.loads(query.stdout) == [{"n": 3}]
    out = tmp_path_factory.mktemp("out")
    exported = cli("export", "--trace-dir", root, "-o", out / "all.jsonl")
    assert_warned(exported, bad)
    tables = [json.loads(line)["table"] for line in (out / "all.jsonl").read_text().splitlines()]
    assert tables.count("requests") == 3
    report = cli("report", root, "--request-id", ids[0], "-o", out / "r.html")
    assert_warned(report, bad)
    assert (out / "r.html").stat().st_size > 1000


def test_traces_check_lists_and_repair_quarantines(damaged):
    root, ids, bad = damaged
    day = bad[0].parent
    orphan = day / "part-00000000000000000000000000000000.parquet"  # renamed, never committed, 2 h old
    orphan.write_bytes(bad[1].read_bytes())
    abandoned = day / ".part-dead.parquet.tmp"
    abandoned.write_bytes(b"PAR1 torn")
    young = day / ".part-live.parquet.tmp"  # a writer at work: left alone
    young.write_bytes(b"PAR1")
    old = time.time() - 7200
    for path in (orphan, abandoned):
        os.utime(path, (old, old))

    listed = cli("traces", "check", "--trace-dir", root)
    assert listed.exit_code == 1, listed.output
    kinds = {line.split()[0]: line for line in listed.stdout.splitlines()[:-1]}
    assert set(kinds) == {"damaged", "orphaned", "abandoned"}
    for path in bad:
        assert f"damaged   {path}:" in listed.stdout
    assert f"orphaned  {orphan}:" in listed.stdout and f"abandoned {abandoned}:" in listed.stdout
    assert str(young) not in listed.stdout
    assert "3 damaged, 1 orphaned, 1 abandoned" in listed.stdout.splitlines()[-1]
    assert all(p.exists() for p in [*bad, orphan, abandoned])  # no --repair: nothing moved

    repaired = cli("traces", "check", "--trace-dir", root, "--repair", "--json")
    assert repaired.exit_code == 0, repaired.output
    findings = json.loads(repaired.stdout)["findings"]
    assert len(findings) == 5
    for finding in findings:
        target = Path(finding["quarantined_to"])
        assert target.is_file() and (root / "_quarantine") in target.parents
        assert not Path(finding["path"]).exists()
    assert young.exists()
    clean = cli("traces", "check", "--trace-dir", root)
    assert clean.exit_code == 0 and "0 damaged, 0 orphaned, 0 abandoned" in clean.stdout
    after = cli("traces", "list", "--trace-dir", root, "--json")
    assert after.exit_code == 0 and not warning_lines(after.stderr)
    assert len(after.stdout.splitlines()) == 3


def test_check_decodes_data_behind_a_good_footer(tmp_path: Path):
    result = synthetic_result(0, tier=3)
    write_trace(result, tmp_path, compression="none")
    path = file_of(tmp_path, "token_events", result.request_id)
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    body = len(data) - footer - 8
    data[4:body] = os.urandom(body - 4)  # pages trashed, footer intact
    path.write_bytes(bytes(data))
    found = check_dataset(tmp_path, grace_s=3600)
    assert [d.path for d in found.scan.damaged] == [path]


def test_bad_check_input(tmp_path: Path):
    for args, expected in ((("--trace-dir", tmp_path / "missing"), "does not exist"),
                           (("--trace-dir", tmp_path, "--grace", "soon"), "retention period")):
        result = cli("traces", "check", *args)
        assert result.exit_code == 2 and result.stderr.startswith("error: ") and expected in result.stderr


def test_server_names_skipped_files_in_a_header(damaged, tiny_engine):
    from fastapi.testclient import TestClient

    from sparseety.serve import ServeConfig, create_app

    root, ids, bad = damaged
    config = ServeConfig(model="tiny-llama", trace_dir=str(root), api_key="k")
    with TestClient(create_app(config, tiny_engine("llama"))) as client:
        headers = {"Authorization": "Bearer k"}
        listed = client.get("/v1/traces", headers=headers)
        assert listed.status_code == 200
        assert {row["request_id"] for row in listed.json()["data"]} == set(ids[:3])
        assert listed.headers["X-Sparseety-Skipped-Files"] == "3"
        assert all(str(p) in listed.headers["X-Sparseety-Warning"] for p in bad)
        one = client.get(f"/v1/traces/{ids[0]}", headers=headers)
        assert one.status_code == 200 and one.json()["request_id"] == ids[0]
        assert one.headers["X-Sparseety-Skipped-Files"] == "3"
