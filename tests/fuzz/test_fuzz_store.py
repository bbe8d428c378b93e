"""Fuzzed trace datasets: truncated, overwritten, foreign, stray and uncommitted files, and damaged
commit manifests. Readers never fail with anything but a clear RecordError (usually they skip the file
with a warning), every request none of whose files was touched is still read whole, ``traces check``
names every damaged file and ``--repair`` leaves a dataset readers read without a warning."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fuzz_helpers import assert_clean, examples
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.errors import RecordError
from sparseety.store import connect, list_traces, load_trace, write_trace
from sparseety.store.commits import manifest_paths
from sparseety.store.export import export_jsonl
from sparseety.store.notices import collected
from sparseety.store.synthetic import synthetic_result

REQUESTS = 4


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    for i in range(REQUESTS):
        write_trace(synthetic_result(i, tier=3), root)
    return root


DAMAGE = st.sampled_from(["truncate", "overwrite", "foreign", "stray", "wrong_table", "empty", "manifest_garbage",
                          "manifest_delete", "temp"])


def damage(root: Path, kind: str, index: int, cut: float, noise: bytes) -> list[Path]:
    """Apply one fault; returns the data files it touched."""
    files = sorted(root.rglob("part-*.parquet"))
    target = files[index % len(files)]
    if kind == "truncate":
        target.write_bytes(target.read_bytes()[: int(target.stat().st_size * cut)])
    elif kind == "overwrite":
        data = bytearray(target.read_bytes())
        at = int(len(data) * cut) % max(len(data), 1)
        data[at: at + len(noise)] = noise
        target.write_bytes(bytes(data))
    elif kind == "foreign":
        pq.write_table(pa.table({"request_id": ["x"], "other": [1.5]}), target)
    elif kind == "wrong_table":
        other = next(f for f in files if f.parent.parent.name != target.parent.parent.name)
        shutil.copyfile(other, target)
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "stray":
        (target.parent / "part-stray.parquet").write_bytes(noise or b"PAR1")
        return []
    elif kind == "temp":
        (target.parent / ".part-dead.parquet.tmp").write_bytes(noise)
        return []
    else:
        manifests = manifest_paths(root)
        if not manifests:
            return []
        manifest = manifests[index % len(manifests)]
        try:
            committed = [root / line for line in json.loads(manifest.read_text())["files"]]
        except (ValueError, TypeError, KeyError):  # garbled by an earlier fault: its files are already hit
            committed = []
        if kind == "manifest_delete":
            manifest.unlink()
        else:
            manifest.write_bytes(noise)
        return committed
    return [target]


def ids_of(files: list[Path]) -> set[str]:
    """The requests whose rows the given (pristine) files hold."""
    return {rid for f in files for rid in pq.read_table(f, columns=["request_id"]).column("request_id").to_pylist()}


@examples(25)
@given(faults=st.lists(st.tuples(DAMAGE, st.integers(0, 100), st.floats(0, 1), st.binary(max_size=40)),
                       min_size=1, max_size=3))
@pytest.mark.slow
def test_readers_survive_any_damage(faults, pristine: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged") / "traces"
    shutil.copytree(pristine, root)
    touched: list[Path] = []
    for kind, index, cut, noise in faults:
        touched += damage(root, kind, index, cut, noise)
    pristine_files = {p.relative_to(pristine) for p in pristine.rglob("part-*.parquet")}
    hit = ids_of([pristine / p.relative_to(root) for p in touched if p.relative_to(root) in pristine_files])
    untouched = {synthetic_result(i, tier=3).request_id for i in range(REQUESTS)} - hit

    with collected() as notes:
        try:
            con = connect(root)
            seen = {r[0] for r in con.sql("SELECT request_id FROM requests").fetchall()}
            assert untouched <= seen  # nothing committed and unharmed is lost
            for request_id in untouched:
                trace = load_trace(root, request_id)
                assert trace.arrays["step_importance"].shape[0] > 0
            list_traces(root, limit=10)
            with open(os.devnull, "w") as sink:
                export_jsonl(root, sink)
        except RecordError:
            pass  # a clear error (damage past a footer DuckDB reads lazily), never another exception
    for note in notes:
        assert note.startswith("skipped damaged file ")

    check = CliRunner().invoke(app, ["traces", "check", "--trace-dir", str(root), "--grace", "0s"])
    assert_clean(check)
    repaired = CliRunner().invoke(app, ["traces", "check", "--trace-dir", str(root), "--grace", "0s", "--repair"])
    assert_clean(repaired)
    assert repaired.exit_code == 0
    after = CliRunner().invoke(app, ["traces", "list", "--trace-dir", str(root), "--json", "--limit", "50"])
    assert after.exit_code == 0 and "warning:" not in after.stderr, after.output
    again = CliRunner().invoke(app, ["traces", "check", "--trace-dir", str(root), "--grace", "0s"])
    assert again.exit_code == 0, again.output
