"""A writer killed with SIGKILL at every commit point of a batch (before each file rename and before
its manifest): no reader ever sees part of a batch, what was committed before stays whole, and what
the kill left behind is found by ``traces check`` and removed by ``gc`` past the grace period."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.store import connect
from sparseety.store.commits import manifest_paths
from sparseety.store.retention import collect_garbage
from sparseety.store.scan import scan_dataset
from sparseety.store.synthetic import synthetic_result

TABLES = ("requests", "token_events", "important_tokens", "signals")
BATCH_FILES = 4 * 2  # four tables x two day partitions, then one manifest

WRITER = textwrap.dedent("""
    import os, signal, sys
    from datetime import UTC, datetime, timedelta
    from sparseety.store import write_trace
    from sparseety.store.rows import StoreOptions, request_rows
    from sparseety.store.synthetic import synthetic_result
    from sparseety.store.writer import commit_rows

    root, kill_at = sys.argv[1], int(sys.argv[2])
    now = datetime.now(UTC)
    write_trace(synthetic_result(0, tier=3), root, created_at=now)  # committed before the batch
    batch = [request_rows(synthetic_result(i, tier=3), StoreOptions(), created_at=now - timedelta(days=i % 2))
             for i in (1, 2, 3)]
    calls, real_replace = [0], os.replace

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = replace
    commit_rows(__import__("pathlib").Path(root), batch)
    print("committed", flush=True)
""")


def rows_per_request(root: Path) -> dict[str, dict[str, int]]:
    con = connect(root)
    out: dict[str, dict[str, int]] = {}
    for table in TABLES:
        for request_id, n in con.sql(f"SELECT request_id, count(*) FROM {table} GROUP BY request_id").fetchall():
            out.setdefault(request_id, {})[table] = n
    return out


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> dict[str, dict[str, int]]:
    """Rows per request and table when nothing is killed."""
    root = tmp_path_factory.mktemp("complete")
    run = subprocess.run([sys.executable, "-c", WRITER, str(root), "0"], capture_output=True, text=True, check=True)
    assert "committed" in run.stdout
    return rows_per_request(root)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", range(1, BATCH_FILES + 2))
def test_kill_at_every_commit_point(kill_at: int, complete, tmp_path: Path):
    run = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), str(kill_at)], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    seen = rows_per_request(tmp_path)
    first = synthetic_result(0, tier=3).request_id
    assert seen == {first: complete[first]}  # the earlier commit whole, nothing of the killed batch
    assert len(complete) == 4 and all(set(rows) == set(TABLES) for rows in complete.values())

    scan = scan_dataset(tmp_path, grace_s=0.0)
    leftovers = scan.orphaned + scan.abandoned
    assert len(leftovers) == kill_at  # kill_at - 1 renamed data files (or the batch) and one temporary file
    assert not scan.damaged
    check = CliRunner().invoke(app, ["traces", "check", "--trace-dir", str(tmp_path), "--grace", "0s"])
    assert check.exit_code == 1 and len(check.stdout.splitlines()) == len(leftovers) + 1

    kept = collect_garbage(tmp_path, timedelta(days=3650), grace=timedelta(hours=1))
    assert not kept.orphaned_files and not kept.stale_temp_files  # a writer may still be at work: kept
    later = datetime.now(UTC) + timedelta(hours=2)
    gone = collect_garbage(tmp_path, timedelta(days=3650), now=later, grace=timedelta(hours=1))
    assert sorted(gone.orphaned_files + gone.stale_temp_files) == sorted(leftovers)
    assert not any(p.exists() for p in leftovers)
    assert rows_per_request(tmp_path) == seen
    assert len(manifest_paths(tmp_path)) == 1


def test_no_kill_commits_the_whole_batch(complete):
    assert len(complete) == 4


def test_a_dataset_without_commit_log_is_read_and_upgraded(tmp_path: Path):
    import json

    from sparseety.store import write_trace
    from sparseety.store.dataset import MARKER

    write_trace(synthetic_result(0), tmp_path)
    for manifest in manifest_paths(tmp_path):  # as an older sparseety wrote it
        manifest.unlink()
    marker = json.loads((tmp_path / MARKER).read_text())
    del marker["commit_log"]
    (tmp_path / MARKER).write_text(json.dumps(marker))
    assert list(rows_per_request(tmp_path)) == [synthetic_result(0).request_id]  # every file counts as committed
    write_trace(synthetic_result(1), tmp_path)  # a new writer commits the old files, then its own
    assert len(rows_per_request(tmp_path)) == 2
    assert "commit_log" in json.loads((tmp_path / MARKER).read_text())
