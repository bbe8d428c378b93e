"""Start a bench as its own process and SIGKILL it once its first case is done (the resume tests' first half)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

SPARSEETY = str(Path(sys.executable).parent / "sparseety")


def kill_after_first_case(args: list[str], out: Path, out_flag: str, results: str, total: int,
                          label: str) -> list[dict[str, Any]]:
    """Run ``sparseety ARGS OUT_FLAG OUT``, kill it at its ``[1/TOTAL] LABEL cases:`` line, return the kept results.

    ``results`` names the JSON file the bench rewrites after every case (``passkey.json``, ``ruler.json``);
    it must say the run is unfinished and hold at least one but not every case.
    """
    proc = subprocess.Popen([SPARSEETY, *args, out_flag, str(out)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    first = ""
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith(f"[1/{total}] {label} cases:"):
                first = line
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert first, "no progress line before the kill"
    partial = json.loads((out / results).read_text())
    assert partial["complete"] is False and 1 <= len(partial["results"]) < total
    return partial["results"]
