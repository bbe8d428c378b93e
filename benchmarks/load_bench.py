"""Load benchmark: the first (GGUF-converting) load of the default model against a cached load.

Both loads run in one invocation, each in a fresh Python subprocess, with ``SPARSEETY_CACHE``
pointed at a new temporary directory: the first subprocess finds an empty cache and converts the
GGUF file once into safetensors; the second finds that cache and loads from it. Each subprocess
reports the time of the ``load_model`` call itself and the time of the imports before it; the
parent also times the whole subprocess (interpreter start, imports, load, exit).

Target (issue 2): the cached load takes a few seconds, not the ~35 s of a GGUF de-quantization.

Usage::

    .venv/bin/python -m benchmarks.load_bench [--model smollm2-135m] [--output benchmarks/results/load/load.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import command, machine, source

RESULTS = Path(__file__).resolve().parent / "results" / "load" / "load.json"
CACHED_TARGET_S = 5.0  # "a few seconds"

# Runs inside the subprocess: time the imports, then one load_model call, and print one JSON line.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
from sparseety.models import load_model
from sparseety.models.gguf_cache import cache_root
t1 = time.perf_counter()
model, tokenizer = load_model(sys.argv[1])
t2 = time.perf_counter()
params = sum(p.numel() for p in model.parameters())
print("LOAD_BENCH " + json.dumps({
    "import_s": t1 - t0, "load_s": t2 - t1, "parameters": params,
    "dtype": str(next(model.parameters()).dtype), "cache_root": str(cache_root()),
    "torch": torch.__version__, "transformers": transformers.__version__,
}))
"""


def run_child(model: str, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"load subprocess failed with exit code {proc.returncode}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("LOAD_BENCH "))
    out = json.loads(line.removeprefix("LOAD_BENCH "))
    out["subprocess_wall_s"] = wall
    return out


def cache_files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sparseety-load-bench-") as tmp:
        env = dict(os.environ, SPARSEETY_CACHE=tmp)
        load_before = [round(x, 2) for x in os.getloadavg()]
        first = run_child(args.model, env)
        after_first = cache_files(Path(tmp))
        cached = run_child(args.model, env)
        after_cached = cache_files(Path(tmp))
        cache_bytes = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())

    converted_once = bool(after_first) and after_first == after_cached  # second load wrote nothing
    ratio = first["load_s"] / cached["load_s"]
    result = {
        "benchmark": "load_bench",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command(),
        "source": source(),
        "machine": machine(load_average_at_start=load_before),
        "model": args.model,
        "first_load": first,
        "cached_load": cached,
        "first_over_cached_load_ratio": ratio,
        "cache_written_once": converted_once,
        "cache_bytes": cache_bytes,
        "targets": {
            "cached_load_s": {"value": cached["load_s"], "target": f"<= {CACHED_TARGET_S} s (a few seconds)",
                              "pass": cached["load_s"] <= CACHED_TARGET_S},
        },
    }
    print(f"model {args.model}  (fresh cache dir, each load in its own subprocess)")
    for name, r in (("first load (converts GGUF)", first), ("cached load", cached)):
        print(f"  {name:28s} load_model {r['load_s']:7.2f} s   imports {r['import_s']:5.2f} s   "
              f"subprocess wall {r['subprocess_wall_s']:6.2f} s")
    print(f"  first / cached load_model ratio: {ratio:.1f}x")
    print(f"  cache written once and reused: {converted_once}  ({cache_bytes / 2**20:.0f} MiB)")
    verdict = "PASS" if result["targets"]["cached_load_s"]["pass"] else "MISS"
    print(f"  target cached load <= {CACHED_TARGET_S:.0f} s: {verdict}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
