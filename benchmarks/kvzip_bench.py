"""kvzip benchmark: its prefill cost (the extra reconstruction pass) against dense prefill, and its decode speed
at a budget against ``streaming``'s, in one process (issue 15's speed targets).

The prompt is real text, as in ``decode_bench.py``: the first ``--context`` tokens of
``/usr/share/common-licenses/GPL-3`` as a plain prompt (no chat template), greedy, ``--new-tokens``
new tokens. Four runs per round, ``dense``, ``streaming``, ``kvzip`` and ``kvzip`` with ``attend=chunk`` (all
three at ``--budget``); round 2 runs them in reverse order (ABCD DCBA), because the 2-core machine is shared and drifts.

Timing, as ``decode_bench.py``: hooks on the model stamp every forward's start and end on the process
CPU clock (one torch thread; the wall clock is recorded beside it). Prefill is everything from the
first forward's start to the first decode forward's start: for ``kvzip`` the prompt forward, the
reconstruction forwards (``ceil(context / chunk_size)``) and the eviction; for the others the prompt
forward and its scoring and eviction. A decode step is the time between the starts of two
consecutive decode forwards (the last: its forward alone); decode tokens/s is ``1 / median(step)``
pooled over the rounds.

Targets (issue 15): kvzip prefill <= 2.2 x dense prefill; kvzip decode tokens/s at budget 1024 on ~7k
tokens >= 0.9 x streaming's.

Usage::

    .venv/bin/python -m benchmarks.kvzip_bench              # ~7k context, budget 1024, 2 rounds
    .venv/bin/python -m benchmarks.kvzip_bench --quick      # 1k context, budget 256, 1 round
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import CLOCKS, ForwardClock, command, machine, source
from sparseety.engine import EncodedInput, SparseEngine, encode_prompt
from sparseety.models import load_model
from sparseety.policies import build_policy

RESULTS = Path(__file__).resolve().parent / "results" / "kvzip" / "kvzip.json"
TEXT = Path("/usr/share/common-licenses/GPL-3")
TARGET_PREFILL = 2.2
TARGET_DECODE = 0.9


#: The runs of a round: (label, policy, extra kvzip options). ``kvzip_chunk``: ``attend=chunk``, whose
#: reconstruction rows attend to the chunk they repeat (and the sinks) instead of the whole context.
RUNS = [("dense", "dense", {}), ("streaming", "streaming", {}), ("kvzip", "kvzip", {}),
        ("kvzip_chunk", "kvzip", {"attend": "chunk"})]


def measure(engine: SparseEngine, clock: ForwardClock, encoded: EncodedInput, label: str, name: str,
            options: dict[str, str], budget: int | None, new_tokens: int, chunk_size: int) -> dict[str, Any]:
    policy = build_policy(name, budget, {"chunk_size": str(chunk_size), **options} if name == "kvzip" else None)
    prefill_forwards = 1 + (math.ceil(encoded.input_len / chunk_size) if name == "kvzip" else 0)
    clock.reset()
    load = os.getloadavg()[0]
    result = engine.generate(encoded, policy, max_new_tokens=new_tokens, tier=1)
    out: dict[str, Any] = {"label": label, "policy": name, "options": options, "budget": budget, "new_tokens": len(result.output_ids),
                           "output_ids": result.output_ids, "kv_cache_bytes_peak": result.kv_cache_bytes_peak,
                           "kv_cache_bytes_dense": result.kv_cache_bytes_dense, "loadavg_before": load,
                           "forwards": len(clock.starts["cpu"]), "prefill_forwards": prefill_forwards}
    for c in CLOCKS:
        s, e = clock.starts[c], clock.ends[c]
        assert len(s) == prefill_forwards + new_tokens - 1, (name, len(s))
        decode = s[prefill_forwards:]
        steps = [decode[i + 1] - decode[i] for i in range(len(decode) - 1)] + [e[-1] - decode[-1]]
        out[c] = {"prefill_s": decode[0] - s[0], "steps_s": steps}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.context, args.budget, args.new_tokens, args.rounds = 1000, 256, 16, 1
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine = SparseEngine(model, tokenizer, args.model)
    clock = ForwardClock(model)
    ids = encode_prompt(tokenizer, TEXT.read_text(), chat=False).input_ids[:, : args.context]
    encoded = EncodedInput(ids)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for r in range(args.rounds):
        for label, name, options in (RUNS if r % 2 == 0 else RUNS[::-1]):
            budget = None if name == "dense" else args.budget
            run = measure(engine, clock, encoded, label, name, options, budget, args.new_tokens, args.chunk_size)
            run["round"] = r
            runs.append(run)
            print(f"round {r} {label:11s} prefill {run['cpu']['prefill_s']:7.2f} s cpu "
                  f"({run['wall']['prefill_s']:7.2f} wall), decode median "
                  f"{1e3 * statistics.median(run['cpu']['steps_s']):6.1f} ms/token cpu, load {run['loadavg_before']:.1f}",
                  flush=True)

    def pooled(label: str, c: str) -> dict[str, float]:
        mine = [x for x in runs if x["label"] == label]
        steps = [s for x in mine for s in x[c]["steps_s"]]
        return {"prefill_s": statistics.median(x[c]["prefill_s"] for x in mine),
                "decode_tokens_per_s": 1.0 / statistics.median(steps)}

    figures: dict[str, Any] = {}
    for c in CLOCKS:
        d, s, k, kc = pooled("dense", c), pooled("streaming", c), pooled("kvzip", c), pooled("kvzip_chunk", c)
        figures[c] = {
            "dense": d, "streaming": s, "kvzip": k, "kvzip_chunk": kc,
            "kvzip_prefill_over_dense": k["prefill_s"] / d["prefill_s"],
            "kvzip_chunk_prefill_over_dense": kc["prefill_s"] / d["prefill_s"],
            "streaming_prefill_over_dense": s["prefill_s"] / d["prefill_s"],
            "kvzip_decode_over_streaming": k["decode_tokens_per_s"] / s["decode_tokens_per_s"],
        }
    dense_ids = next(x["output_ids"] for x in runs if x["label"] == "dense")
    agree = {label: sum(a == b for a, b in zip(next(x["output_ids"] for x in runs if x["label"] == label), dense_ids))
             for label, _, _ in RUNS[1:]}
    kv = {x["label"]: x["kv_cache_bytes_peak"] for x in runs}
    report = {
        "benchmark": "kvzip_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command(), "source": source(), "machine": machine(),
        "model": args.model, "context": encoded.input_len, "budget": args.budget, "new_tokens": args.new_tokens,
        "chunk_size": args.chunk_size, "rounds": args.rounds, "primary_clock": "cpu",
        "targets": {"kvzip_prefill_over_dense_max": TARGET_PREFILL, "kvzip_decode_over_streaming_min": TARGET_DECODE},
        "figures": figures,
        "met": {"prefill": figures["cpu"]["kvzip_prefill_over_dense"] <= TARGET_PREFILL,
                "prefill_attend_chunk": figures["cpu"]["kvzip_chunk_prefill_over_dense"] <= TARGET_PREFILL,
                "decode": figures["cpu"]["kvzip_decode_over_streaming"] >= TARGET_DECODE},
        "tokens_equal_to_dense": agree, "kv_cache_bytes_peak": kv,
        "elapsed_wall_s": round(time.perf_counter() - started, 1), "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    f = figures["cpu"]
    print(f"kvzip prefill {f['kvzip']['prefill_s']:.2f} s = {f['kvzip_prefill_over_dense']:.2f}x dense "
          f"({f['dense']['prefill_s']:.2f} s; target <= {TARGET_PREFILL}); attend=chunk {f['kvzip_chunk']['prefill_s']:.2f} s = "
          f"{f['kvzip_chunk_prefill_over_dense']:.2f}x; streaming {f['streaming_prefill_over_dense']:.2f}x")
    print(f"kvzip decode {f['kvzip']['decode_tokens_per_s']:.2f} tok/s = {f['kvzip_decode_over_streaming']:.3f}x streaming "
          f"({f['streaming']['decode_tokens_per_s']:.2f} tok/s; target >= {TARGET_DECODE})")
    print(f"tokens equal to dense (of {args.new_tokens}): {agree}; KV peak bytes {kv}; wrote {args.out}")


if __name__ == "__main__":
    main()
