"""TraceWriter: nothing lost at volume, drops counted when full, errors recorded, close flushes."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sparseety.errors import ConfigError, SparseetyError
from sparseety.store import TraceWriter, connect, load_trace
from sparseety.store.synthetic import synthetic_result


def stream(n: int, templates: int = 10, **shape):
    """``n`` distinct requests built from a few synthetic templates (only the ids differ)."""
    base = [synthetic_result(i, **shape) for i in range(templates)]
    return [replace(base[i % templates], request_id=f"req-{i:05d}") for i in range(n)]


def scalar(con, sql: str, params: list | None = None):
    return con.sql(sql, params=params or []).fetchall()[0][0]


def test_ten_thousand_requests_at_tier2_nothing_lost(tmp_path: Path):
    results = stream(10_000, tier=2, prompt_len=8, new_tokens=3, layers=2, kv_heads=1, top_k=2)
    writer = TraceWriter(tmp_path, queue_size=len(results), batch_rows=20_000)
    assert all(writer.submit(r) for r in results)
    stats = writer.close()
    assert (stats.accepted, stats.dropped_records, stats.committed_requests, stats.failed_records) == (10_000, 0, 10_000, 0)
    con = connect(tmp_path)
    assert scalar(con, "SELECT count(*) FROM requests") == 10_000
    assert scalar(con, "SELECT count(DISTINCT request_id) FROM requests") == 10_000
    assert scalar(con, "SELECT count(*) FROM token_events") == sum(len(r.arrays["evicted.position"]) for r in results)
    assert scalar(con, "SELECT count(*) FROM important_tokens") == sum(len(r.important_tokens) for r in results)
    assert scalar(con, "SELECT count(*) FROM signals WHERE kind = 'importance'") == 2 * 10_000
    assert scalar(con, "SELECT sum(eviction_events) FROM requests") == sum(r.eviction_events for r in results)
    # Per request, events match the request's own count (nothing crossed between requests).
    mismatched = scalar(con, """
        SELECT count(*) FROM requests r LEFT JOIN (
            SELECT request_id, count(*) AS n FROM token_events GROUP BY request_id) e USING (request_id)
        WHERE coalesce(e.n, 0) <> r.eviction_events""")
    assert mismatched == 0


def test_full_queue_drops_and_counts_without_waiting(tmp_path: Path):
    """With the writer thread held, submit past the queue's size returns False at once, every time."""
    results = stream(25, tier=2)
    writer = TraceWriter(tmp_path, queue_size=10)
    writer.pause()
    accepted = [writer.submit(r) for r in results]  # completes: submit never waits for the held thread
    assert accepted == [True] * 10 + [False] * 15
    stats = writer.stats()
    assert (stats.accepted, stats.dropped_records, stats.queue_depth, stats.committed_requests) == (10, 15, 10, 0)
    writer.resume()
    stats = writer.close()
    assert (stats.committed_requests, stats.dropped_records) == (10, 15)
    stored = {row[0] for row in connect(tmp_path).sql("SELECT request_id FROM requests").fetchall()}
    assert stored == {r.request_id for r in results[:10]}


def test_close_flushes_everything_accepted_and_is_idempotent(tmp_path: Path):
    results = stream(30, tier=3)
    writer = TraceWriter(tmp_path, flush_interval_s=3600, batch_rows=10**9)  # only close() commits
    for r in results:
        writer.submit(r)
    assert writer.close() == writer.close()
    assert scalar(connect(tmp_path), "SELECT count(*) FROM requests") == 30
    with pytest.raises(SparseetyError, match="closed"):
        writer.submit(results[0])


def test_flush_commits_and_reports(tmp_path: Path):
    commits = []
    writer = TraceWriter(tmp_path, flush_interval_s=3600, on_commit=commits.append)
    results = stream(5, tier=2)
    for r in results:
        writer.submit(r)
    assert writer.flush(timeout=60)
    assert [rid for c in commits for rid in c.request_ids] == [r.request_id for r in results]
    assert all(p.exists() for c in commits for p in c.files)
    assert commits[-1].files[-1].parent.parent.name == "requests"  # the requests file lands last
    assert load_trace(writer.path_of(results[2].request_id), results[2].request_id).request_id == results[2].request_id
    writer.close()


def test_a_bad_record_is_counted_and_the_thread_goes_on(tmp_path: Path):
    good = stream(3, tier=2)
    writer = TraceWriter(tmp_path)
    writer.submit(good[0])
    assert writer.submit(good[1], sample_rate=2.0)  # accepted, then refused in the thread
    writer.submit(good[2])
    stats = writer.close()
    assert (stats.accepted, stats.failed_records, stats.committed_requests) == (3, 1, 2)
    assert "sample rate" in stats.last_error
    stored = {row[0] for row in connect(tmp_path).sql("SELECT request_id FROM requests").fetchall()}
    assert stored == {good[0].request_id, good[2].request_id}


def test_a_write_error_is_counted(tmp_path: Path):
    """A file where the partition folder must go makes the commit fail; the writer counts it."""
    writer = TraceWriter(tmp_path, flush_interval_s=3600)
    writer.submit(stream(1)[0])
    for table in ("requests", "token_events", "important_tokens", "signals"):
        (tmp_path / table).mkdir(exist_ok=True)
        (tmp_path / table / f"date={datetime.now(UTC).date().isoformat()}").write_text("not a folder")
    stats = writer.close()
    assert stats.failed_records == 1 and stats.committed_requests == 0 and stats.last_error


@pytest.mark.parametrize("kwargs", [{"queue_size": 0}, {"batch_rows": 0}, {"flush_interval_s": 0}])
def test_bad_writer_settings(kwargs, tmp_path: Path):
    with pytest.raises(ConfigError):
        TraceWriter(tmp_path, **kwargs)
