"""A writer process killed with SIGKILL mid-stream: every batch it reported committed is readable,
and nothing it left behind makes a reader or a query fail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sparseety.store import connect, list_traces, load_trace

WRITER = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    from sparseety.store import TraceWriter
    from sparseety.store.synthetic import synthetic_result

    def report(commit):
        print(json.dumps(commit.request_ids), flush=True)

    base = [synthetic_result(i, tier=3, prompt_len=64, new_tokens=8, layers=4) for i in range(8)]
    writer = TraceWriter(sys.argv[1], queue_size=64, batch_rows=400, flush_interval_s=0.02, on_commit=report)
    i = 0
    while True:  # until killed
        writer.submit(replace(base[i % 8], request_id=f"req-{i:07d}"))
        i += 1
""")


@pytest.mark.slow
def test_sigkill_mid_stream_leaves_a_readable_dataset(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    committed: list[str] = []
    try:
        for line in proc.stdout:
            committed.extend(json.loads(line))
            if len(committed) >= 40:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(committed) >= 40
    # A writer killed inside write_table leaves a dot-prefixed temporary file; plant a torn one too.
    partition = next((tmp_path / "signals").glob("date=*"))
    (partition / ".part-torn.parquet.tmp").write_bytes(b"PAR1 half a footer")

    con = connect(tmp_path)
    stored = {row[0] for row in con.sql("SELECT request_id FROM requests").fetchall()}
    assert set(committed) <= stored
    for table in ("requests", "token_events", "important_tokens", "signals"):
        con.sql(f"SELECT count(*), count(DISTINCT request_id) FROM {table}").fetchall()  # no reader error
    # Every committed request is complete: its events and its vectors are there.
    per_request = dict(con.sql(
        "SELECT request_id, count(*) FROM signals WHERE kind = 'step_importance' GROUP BY request_id").fetchall())
    assert all(per_request.get(rid) == 8 * 4 for rid in committed)
    assert list_traces(tmp_path, limit=5)
    sample = load_trace(tmp_path, committed[len(committed) // 2])
    assert sample.arrays["step_importance"].shape == (8, 4, 71)
    assert np.isfinite(sample.arrays["importance"].astype(np.float32)).all()
