"""``benchmarks/paired_cases.py`` on result files written here: paired counts, the exact sign test, aliases."""

from __future__ import annotations

import json
import subprocess
import sys
from math import comb
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  #: ``python -m benchmarks.paired_cases`` runs from here


def _row(policy: str, index: int, score: float, ratio: float = 0.5, task: str = "niah_multikey") -> dict:
    return {"policy": policy, "ratio": ratio, "task": task, "length": 1000, "depth": 0.5, "index": index,
            "seed": 0, "answer": "", "score": score, "seconds": 1.0, "kv_bytes": 1}


def _write(path: Path, ours: list[dict], theirs: list[dict]) -> Path:
    path.write_text(json.dumps({"rows": {"sparseety": ours, "kvpress": theirs}}))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.paired_cases", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_paired_counts_and_the_exact_sign_test(tmp_path):
    # A wins cases 0-6, B wins case 7, both solve 8-9, both fail 10; B alone ran case 11 (not shared)
    a = [_row("kvzap", i, 1.0 if i < 7 or i in (8, 9) else 0.0) for i in range(11)]
    b = [_row("kvzap", i, 1.0 if i in (7, 8, 9, 11) else 0.0) for i in range(12)]
    out = tmp_path / "paired.json"
    done = _run(str(_write(tmp_path / "r.json", a, b)), "--a", "sparseety:kvzap", "--b", "kvpress:kvzap",
                "--out", str(out))
    assert done.returncode == 0, done.stderr
    got = json.loads(out.read_text())["tasks"]["niah_multikey"]
    expected_p = 2 * (comb(8, 0) + comb(8, 1)) / 2**8  # 7 against 1 discordant cases
    assert got == {"cases": 11, "score_a": 9.0, "score_b": 3.0, "a_over_b": 3.0, "a_better": 7, "b_better": 1,
                   "sign_test_p": float(f"{expected_p:.4g}")}


def test_an_alias_renames_one_files_rows_and_a_later_file_wins(tmp_path):
    # the old file's "kvzap" is today's kvzap_uniform; the new file's kvzap_per_head is today's kvzap
    old = _write(tmp_path / "old.json", [_row("kvzap", i, 1.0) for i in range(4)] + [_row("kvzip", i, 1.0) for i in range(4)], [])
    new = _write(tmp_path / "new.json", [_row("kvzap_per_head", i, float(i % 2)) for i in range(4)], [])
    done = _run(str(old), str(new), "--alias", "old.json:kvzap=kvzap_uniform", "--alias", "kvzap_per_head=kvzap",
                "--a", "sparseety:kvzap", "--b", "sparseety:kvzip")
    assert done.returncode == 0, done.stderr
    assert "A      2  B      4" in done.stdout and "A better 0, B better 2 | sign test p = 0.5" in done.stdout


def test_bad_names_are_refused_with_the_form_expected(tmp_path):
    path = _write(tmp_path / "r.json", [_row("kvzap", 0, 1.0)], [])
    done = _run(str(path), "--a", "ours:kvzap", "--b", "sparseety:kvzip")
    assert done.returncode != 0 and "SIDE:POLICY with SIDE one of sparseety, kvpress, got 'ours:kvzap'" in done.stderr
    done = _run(str(path), "--a", "sparseety:kvzap", "--b", "sparseety:kvzip", "--alias", "kvzap")
    assert done.returncode != 0 and "--alias takes [FILE_NAME:]OLD=NEW, got 'kvzap'" in done.stderr
    done = _run(str(path), "--a", "sparseety:kvzap", "--b", "sparseety:kvzip")
    assert done.returncode == 0 and "no case ran under both" in done.stdout
