"""Dataset layout, version markers and the errors of a directory that is not (readable as) a dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sparseety.errors import RecordError
from sparseety.schema import SCHEMA_VERSION
from sparseety.store import connect, list_traces, load_trace, write_trace
from sparseety.store.dataset import MARKER
from sparseety.store.synthetic import synthetic_result


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    write_trace(synthetic_result(0, tier=3, experts=2), tmp_path)
    return tmp_path


def test_layout_and_metadata(dataset: Path):
    files = sorted(p.relative_to(dataset).parts[:2] for p in dataset.rglob("*.parquet"))
    assert {f[0] for f in files} == {"requests", "token_events", "important_tokens", "signals"}
    assert all(f[1].startswith("date=") for f in files)
    for path in dataset.rglob("part-*.parquet"):
        meta = pq.read_schema(path).metadata
        assert meta[b"sparseety.schema_version"] == SCHEMA_VERSION.encode()
        assert meta[b"sparseety.table"].decode() == path.parent.parent.name
        assert "date" not in pq.read_schema(path).names  # the partition lives in the folder name
    assert not list(dataset.rglob(".*.tmp"))
    assert json.loads((dataset / MARKER).read_text())["schema_version"] == SCHEMA_VERSION
    (version,) = connect(dataset).sql("SELECT DISTINCT schema_version FROM requests").fetchall()[0]
    assert version == SCHEMA_VERSION


def test_pyarrow_reads_it_as_a_hive_dataset(dataset: Path):
    """Plain Parquet + Hive partitions: pyarrow (as Spark or pandas would) reads it with no help."""
    import pyarrow.dataset as ds

    table = ds.dataset(dataset / "token_events", format="parquet", partitioning="hive").to_table()
    assert table.num_rows == 12 and "date" in table.column_names


def test_newer_major_marker_is_refused(dataset: Path):
    marker = dataset / MARKER
    info = json.loads(marker.read_text())
    info["schema_version"] = f"{int(SCHEMA_VERSION.split('.')[0]) + 1}.0"
    marker.write_text(json.dumps(info))
    for read in (lambda: connect(dataset), lambda: load_trace(dataset), lambda: list_traces(dataset),
                 lambda: write_trace(synthetic_result(1), dataset)):
        with pytest.raises(RecordError, match=r"schema version 2\.0, newer than this sparseety reads"):
            read()


def test_newer_major_file_is_refused(dataset: Path):
    path = next((dataset / "signals").rglob("part-*.parquet"))
    table = pq.read_table(path)
    meta = {**table.schema.metadata, b"sparseety.schema_version": b"7.3"}
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(RecordError, match=rf"trace file .*{path.name} was written with schema version 7\.3"):
        connect(dataset)


def test_a_newer_minor_version_is_read(dataset: Path):
    marker = dataset / MARKER
    info = json.loads(marker.read_text())
    info["schema_version"] = f"{SCHEMA_VERSION.split('.')[0]}.99"
    marker.write_text(json.dumps(info))
    assert load_trace(dataset).tier == 3


def test_not_a_dataset(tmp_path: Path):
    with pytest.raises(RecordError, match="does not exist"):
        connect(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(RecordError, match="is not a sparseety trace dataset"):
        load_trace(tmp_path / "plain")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecordError, match="not a directory"):
        connect(tmp_path / "file")


def test_fresh_dataset_has_empty_views_and_unknown_ids_fail(tmp_path: Path):
    from sparseety.store import TraceWriter

    TraceWriter(tmp_path).close()  # creates the dataset, writes nothing
    con = connect(tmp_path)
    for table in ("requests", "token_events", "important_tokens", "signals"):
        assert con.sql(f"SELECT count(*) FROM {table}").fetchall() == [(0,)]
    assert list_traces(tmp_path) == []
    with pytest.raises(RecordError, match="holds no request yet"):
        load_trace(tmp_path)
    write_trace(synthetic_result(3), tmp_path)
    with pytest.raises(RecordError, match="no request with id 'nope'"):
        load_trace(tmp_path, "nope")


def test_list_traces_newest_first(tmp_path: Path):
    from datetime import UTC, datetime, timedelta

    start = datetime(2026, 1, 1, tzinfo=UTC)
    results = [synthetic_result(i) for i in range(5)]
    for i, result in enumerate(results):
        write_trace(result, tmp_path, created_at=start + timedelta(hours=10 * i))  # spans two partitions
    listed = list_traces(tmp_path, limit=3)
    assert [r["request_id"] for r in listed] == [r.request_id for r in results[::-1][:3]]
    assert listed[0]["eviction_events"] == results[-1].eviction_events
    assert load_trace(tmp_path).request_id == results[-1].request_id
