"""Offline records: parsing, safe paths and score files."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy_safetensors
from safetensors.torch import save_file as save_torch_safetensors

from sparseety.errors import RecordError
from sparseety.extract import (
    OfflineRecord,
    example_record_path,
    load_scores,
    read_records,
)


def record(**overrides) -> dict:
    base = {
        "generation_id": "g1",
        "prompt_tokens": [1, 2, 3],
        "generated_tokens": [4],
        "layer": 2,
        "score_type": "attention",
        "scores_path": "s.npy",
    }
    return {**base, **overrides}


def write(path: Path, *objs: dict) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    else:
        path.write_text(json.dumps(objs[0]))
    return path


def only(entries):
    assert len(entries) == 1
    return entries[0]


def test_a_json_record_parses_and_resolves_its_scores_path(tmp_path):
    rec = only(read_records(write(tmp_path / "r.json", record(layout="hqk", step=3, request_meta={"a": 1}))))
    assert isinstance(rec, OfflineRecord)
    assert rec.token_ids == [1, 2, 3, 4] and rec.layer == 2 and rec.step == 3
    assert rec.scores_path == (tmp_path / "s.npy").resolve()
    assert rec.config_fields() == {"score_type": "attention", "layout": "hqk"}
    assert rec.request_meta == {"a": 1}


def test_jsonl_keeps_good_lines_and_reports_bad_ones(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record()) + "\n\n{not json\n" + json.dumps(record(generation_id=7)) + "\n[1]\n")
    entries = read_records(path)
    assert [type(e).__name__ for e in entries] == ["OfflineRecord", "RecordError", "OfflineRecord", "RecordError"]
    assert f"{path}:3: malformed JSON" in str(entries[1])
    assert "r.jsonl:5: a record must be a JSON object, got a list" in str(entries[3])
    assert entries[2].generation_id == 7


@pytest.mark.parametrize(
    "key", ["generation_id", "prompt_tokens", "generated_tokens", "layer", "score_type", "scores_path"]
)
def test_missing_keys_are_named(tmp_path, key):
    data = record()
    del data[key]
    with pytest.raises(RecordError, match=f"record key '{key}' is missing"):
        read_records(write(tmp_path / "r.json", data))


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("prompt_tokens", "1 2 3", "must be a list, got a string"),
        ("generated_tokens", [1, "x"], "must be a list of non-negative integer token ids"),
        ("prompt_tokens", [1, True], "must be a list of non-negative integer token ids"),
        ("prompt_tokens", [-1], "must be a list of non-negative integer token ids"),
        ("layer", "2", "must be an integer or null, got a string"),
        ("layer", 2.0, "must be an integer or null, got a number"),
        ("score_type", 1, "must be a string, got an integer"),
        ("scores_path", None, "must be a string, got null"),
        ("generation_id", [1], "must be a string or an integer, got a list"),
        ("token_offset", True, "must be an integer or null, got a boolean"),
        ("batch_index", -1, "must not be negative"),
        ("request_meta", [], "must be an object or null"),
        ("layout", 3, "must be a string or null"),
    ],
)
def test_mistyped_keys_are_named(tmp_path, key, value, expected):
    with pytest.raises(RecordError, match=f"record key '{key}' {expected}"):
        read_records(write(tmp_path / "r.json", record(**{key: value})))


def test_malformed_json_file(tmp_path):
    (tmp_path / "r.json").write_text('{"generation_id": ')
    with pytest.raises(RecordError, match="malformed JSON"):
        read_records(tmp_path / "r.json")
    (tmp_path / "two.json").write_text(json.dumps(record()) + "\n" + json.dumps(record()))
    with pytest.raises(RecordError, match=r"\.jsonl extension"):
        read_records(tmp_path / "two.json")


def test_missing_records_file_and_base_dir(tmp_path):
    with pytest.raises(RecordError, match="records file not found"):
        read_records(tmp_path / "nope.json")
    write(tmp_path / "r.json", record())
    with pytest.raises(RecordError, match="base directory not found"):
        read_records(tmp_path / "r.json", base_dir=tmp_path / "nope")


@pytest.mark.parametrize("scores_path", ["../s.npy", "sub/../../s.npy", "/etc/passwd", "link/s.npy", ""])
def test_scores_path_may_not_escape_the_base_dir(tmp_path, scores_path):
    base = tmp_path / "base"
    base.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", base / "link")
    with pytest.raises(RecordError, match="escapes the base directory|not a file name"):
        read_records(write(base / "r.json", record(scores_path=scores_path)))


def test_scores_path_inside_the_base_dir_is_fine_even_with_dots_or_absolute(tmp_path):
    (tmp_path / "sub").mkdir()
    for scores_path in ["sub/../s.npy", "./sub/s.npy", str(tmp_path / "sub" / "s.npy")]:
        rec = only(read_records(write(tmp_path / "r.json", record(scores_path=scores_path))))
        assert rec.scores_path.is_relative_to(tmp_path.resolve())


def test_base_dir_overrides_the_record_folder(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "data").mkdir()
    path = write(tmp_path / "records" / "r.json", record(scores_path="s.npy"))
    assert only(read_records(path, base_dir=tmp_path / "data")).scores_path == (tmp_path / "data" / "s.npy").resolve()
    with pytest.raises(RecordError, match="escapes"):
        read_records(write(path, record(scores_path="../records/r.json")), base_dir=tmp_path / "data")


def test_npy_loads_and_pickled_npy_is_refused(tmp_path):
    np.save(tmp_path / "ok.npy", np.arange(6.0).reshape(2, 3))
    assert load_scores(tmp_path / "ok.npy").shape == (2, 3)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(RecordError, match="pickled data is refused"):
        load_scores(tmp_path / "obj.npy")
    (tmp_path / "raw.npy").write_bytes(pickle.dumps([1.0, 2.0]))
    with pytest.raises(RecordError, match="pickled data is refused"):
        load_scores(tmp_path / "raw.npy")


def test_npz_needs_one_array_or_one_named_scores(tmp_path):
    np.savez(tmp_path / "one.npz", anything=np.ones((2, 2)))
    assert load_scores(tmp_path / "one.npz").shape == (2, 2)
    np.savez(tmp_path / "named.npz", scores=np.ones((3, 3)), other=np.ones(1))
    assert load_scores(tmp_path / "named.npz").shape == (3, 3)
    np.savez(tmp_path / "many.npz", a=np.ones(1), b=np.ones(1))
    with pytest.raises(RecordError, match=r"holds the arrays \['a', 'b'\]"):
        load_scores(tmp_path / "many.npz")
    np.savez(tmp_path / "obj.npz", scores=np.array([None], dtype=object))
    with pytest.raises(RecordError, match="pickled data is refused"):
        load_scores(tmp_path / "obj.npz")


def test_safetensors_load_including_bfloat16(tmp_path):
    save_numpy_safetensors({"scores": np.ones((2, 4), dtype=np.float32)}, str(tmp_path / "a.safetensors"))
    assert tuple(load_scores(tmp_path / "a.safetensors").shape) == (2, 4)
    save_torch_safetensors({"x": torch.ones(3, 3, dtype=torch.bfloat16)}, str(tmp_path / "b.safetensors"))
    assert load_scores(tmp_path / "b.safetensors").dtype == torch.bfloat16
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(RecordError, match="cannot read"):
        load_scores(tmp_path / "bad.safetensors")


def test_missing_or_unsupported_scores_files(tmp_path):
    with pytest.raises(RecordError, match="scores file not found"):
        load_scores(tmp_path / "none.npy")
    (tmp_path / "s.pt").write_bytes(b"x")
    with pytest.raises(RecordError, match=r"unsupported scores file type '\.pt'"):
        load_scores(tmp_path / "s.pt")


def test_the_bundled_example_record_is_valid():
    rec = only(read_records(example_record_path()))
    scores = rec.load_scores()
    assert scores.shape[-1] == len(rec.token_ids) and rec.layout == "hqk"
    assert np.allclose(scores.sum(-1), 1.0, atol=1e-4)  # real softmax rows
