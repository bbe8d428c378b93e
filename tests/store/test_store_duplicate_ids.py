"""A store holding two rows for one request id: readers show the newest copy and warn, never fail."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import numpy as np

from sparseety.store import list_traces, load_trace, write_trace
from sparseety.store.dataset import create_dataset
from sparseety.store.notices import collecting
from sparseety.store.rows import StoreOptions, request_rows
from sparseety.store.synthetic import synthetic_result
from sparseety.store.writer import commit_rows

RID = "same-id"
OLD = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
NEW = datetime(2025, 1, 1, 12, 5, tzinfo=UTC)


def _pair():
    """Two different tier-2 runs under one id: the older one is shorter."""
    old = dataclasses.replace(synthetic_result(1, prompt_len=10, new_tokens=3), request_id=RID)
    new = dataclasses.replace(synthetic_result(2, prompt_len=30, new_tokens=2), request_id=RID)
    return old, new


def test_two_commits_of_one_id_read_as_the_newest_with_its_own_arrays(tmp_path):
    old, new = _pair()
    write_trace(old, tmp_path, created_at=OLD)
    write_trace(new, tmp_path, created_at=NEW)
    stored, notes = collecting(lambda: load_trace(tmp_path, RID))
    assert stored.document["prompt_token_ids"] == new.prompt_ids
    np.testing.assert_array_equal(stored.arrays["importance"], new.arrays["importance"])
    assert stored.arrays["importance"].shape == (2, 31)
    assert [t["position"] for t in stored.document["important_tokens"]] == [t.position for t in new.important_tokens]
    assert notes == [f"request {RID!r} is stored 2 times in {tmp_path}: showing the newest copy "
                     f"({NEW.isoformat()})"]
    rows, notes = collecting(lambda: list_traces(tmp_path))
    assert [(r["request_id"], r["prompt_tokens"]) for r in rows] == [(RID, 30)]
    assert notes == [f"request {RID!r} is stored 2 times in {tmp_path}: listing the newest copy "
                     f"({NEW.isoformat()})"]


def test_two_copies_in_one_commit_read_as_the_newest_without_arrays(tmp_path):
    old, new = _pair()
    options = StoreOptions()
    commit_rows(create_dataset(tmp_path), [request_rows(old, options, created_at=OLD), request_rows(new, options, created_at=NEW)])
    stored, notes = collecting(lambda: load_trace(tmp_path, RID))
    assert stored.document["prompt_token_ids"] == new.prompt_ids
    assert stored.arrays == {} and stored.document["important_tokens"] == []
    assert notes == [f"request {RID!r} is stored 2 times in {tmp_path}: showing the newest copy ({NEW.isoformat()}), "
                     "without its arrays and important tokens (its copies were written together and cannot be told "
                     "apart)"]
