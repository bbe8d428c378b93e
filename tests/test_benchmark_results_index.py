"""Every committed benchmark result is listed in ``benchmarks/README.md`` (with the command that made it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def committed_results() -> list[str]:
    """Paths under ``benchmarks/results`` that git tracks, relative to it (a local run's new files are not)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "--", "benchmarks/results"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [str(Path(p).relative_to("benchmarks/results")) for p in out]


def test_every_committed_result_is_named_in_the_benchmarks_readme():
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    files = committed_results()
    assert files, "no committed results found"
    def named(path: str) -> bool:  # the whole path or its tail (``linear/config.json``, ``passkey.png``) in backticks
        parts = Path(path).parts
        return any(f"`{'/'.join(parts[i:])}`" in readme for i in range(len(parts)))

    unnamed = [f for f in files if not named(f)]
    assert not unnamed, f"results not listed in benchmarks/README.md: {unnamed}"


def test_results_sit_in_one_folder_per_benchmark():
    loose = [f for f in committed_results() if "/" not in f]
    assert not loose, f"results outside a benchmark folder under benchmarks/results/: {loose}"
