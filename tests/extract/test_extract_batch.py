"""``sparseety extract a.json b.json ...``: every record is judged on its own. A record whose scores file
is not what its name says (not a zip, truncated, garbage) becomes that record's one ``error:`` line and
the records after it are processed; a record nothing passes says why instead of staying silent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sparseety.cli import app


def run(*args):
    return CliRunner().invoke(app, ["extract", *map(str, args)])


def record(folder: Path, name: str, scores_name: str) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"generation_id": name, "prompt_tokens": [5, 6, 7, 8], "generated_tokens": [9, 10],
                                "layer": 0, "score_type": "attention", "scores_path": scores_name, "layout": "qk"}))
    return path


def good_scores(folder: Path, name: str) -> str:
    np.save(folder / f"{name}.npy", np.full((2, 6), 1 / 6, dtype=np.float32))
    return f"{name}.npy"


def npz_bytes(folder: Path) -> bytes:
    np.savez(folder / "real.npz", scores=np.ones((2, 6), dtype=np.float32))
    return (folder / "real.npz").read_bytes()


BROKEN = {
    "not_a_zip.npz": lambda folder: b"this is not a zip archive",
    "truncated.npz": lambda folder: npz_bytes(folder)[:60],
    "bad_crc_member.npz": lambda folder: (lambda b: b[:172] + b"\x07" * 8 + b[180:])(npz_bytes(folder)),
    "truncated.npy": lambda folder: (np.save(folder / "t.npy", np.ones((2, 6))), (folder / "t.npy").read_bytes()[:90])[1],
    "garbage.npy": lambda folder: b"\x93NUMPY\x01\x00\xff\xff{garbage",
    "garbage.safetensors": lambda folder: b"\xff" * 64,
    "empty.npz": lambda folder: b"",
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_scores_file_is_that_records_error(broken: str, tmp_path: Path):
    (tmp_path / broken).write_bytes(BROKEN[broken](tmp_path))
    paths = [record(tmp_path, "a", good_scores(tmp_path, "a")), record(tmp_path, "b", broken),
             record(tmp_path, "c", good_scores(tmp_path, "c"))]
    result = run(*paths)
    assert result.exit_code == 1, result.output  # some failed, some succeeded
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and broken in errors[0], result.stderr
    done = {json.loads(line)["generation_id"] for line in result.stdout.splitlines()}
    assert done == {"a", "c"}  # the record after the broken one is processed too
    alone = run(paths[1])
    assert alone.exit_code == 2 and alone.stderr.startswith("error: ") and len(alone.stderr.splitlines()) == 1


def test_a_record_nothing_passes_says_why(tmp_path: Path):
    np.save(tmp_path / "neg.npy", -np.abs(np.random.default_rng(0).normal(size=(2, 6))).astype(np.float32) - 0.1)
    result = run(record(tmp_path, "neg", "neg.npy"), "--normalize", "none")
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.startswith("warning: ") and "no token's score reached min_score" in result.stderr
    assert "neg.json" in result.stderr and "highest -" in result.stderr
