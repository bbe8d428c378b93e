"""Continuous-batching benchmark: what batching and eviction buy in throughput and memory, as ratios in one run.

Prompts are real text: windows of ``/usr/share/common-licenses/GPL-3`` at different offsets (so no two
prompts share a prefix), plain (no chat template), greedy, ``--new-tokens`` new tokens each. One torch
thread; the primary clock is the process CPU time (this 2-core machine is shared, see decode_bench.py),
the wall clock is recorded beside it.

Figures (issue 12, "Speed and memory"):

1. ``short``: 8 prompts of ~250 tokens, dense. Throughput (generated tokens / seconds) of one
   continuous batch against the same prompts run one after another through ``SparseEngine.generate``
   (plain ``model.generate``), interleaved ABBA. Target >= 3.5x. The answers must be identical.
2. ``long``: 8 prompts of ~4,000 tokens. ``streaming`` budget 512 batched against ``dense`` batched:
   decode tokens/s (the steps after every prompt is in; target >= 2x) and end to end beside it; the KV
   bytes reserved (worst case, what admission holds) and held at peak (target <= 1/6).
3. ``admission``: under a KV memory limit that holds 4 dense sequences of 4,000 tokens (+ new
   tokens), how many ``streaming`` budget-512 requests the scheduler admits at once (target >= 24),
   and the batch running: 32 requests queued, their peak concurrency and reservations.

Usage::

    .venv/bin/python -m benchmarks.batch_bench            # ~15 min
    .venv/bin/python -m benchmarks.batch_bench --quick    # ~2 min: 4 prompts, 1,000-token long prompts, 16 tokens
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import command, machine, source
from sparseety.engine import EncodedInput, SparseEngine, encode_prompt
from sparseety.engine.request import GenerationOptions, RequestStatus
from sparseety.models import load_model
from sparseety.policies import build_policy

RESULTS = Path(__file__).resolve().parent / "results" / "batch" / "batch.json"
TEXT = Path("/usr/share/common-licenses/GPL-3")
TARGET_BATCH = 3.5
TARGET_SPARSE_DECODE = 2.0
TARGET_KV = 1 / 6
TARGET_ADMITTED = 24


class Clock:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self) -> Clock:
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *_: Any) -> None:
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0


def prompts(tokenizer: Any, count: int, tokens: int) -> list[EncodedInput]:
    """``count`` plain prompts of exactly ``tokens`` tokens from different parts of GPL-3."""
    ids = encode_prompt(tokenizer, TEXT.read_text(), chat=False).input_ids[0]
    stride = max(1, (ids.numel() - tokens) // max(1, count))
    return [EncodedInput(ids[i * stride : i * stride + tokens].view(1, -1).clone()) for i in range(count)]


def run_batch(engine: SparseEngine, inputs: list[EncodedInput], policy: Any, new_tokens: int,
              kv_limit: int | None = None) -> dict[str, Any]:
    """One continuous batch; times the whole run and the pure-decode steps (every prompt in)."""
    batch = engine.batch(max_batch=len(inputs), prefill_chunk=4096, kv_memory_limit=kv_limit)
    for i, e in enumerate(inputs):
        batch.add(e, policy, GenerationOptions(max_new_tokens=new_tokens, tier=0), request_id=str(i))
    results, decode_tokens = {}, 0
    decode = Clock()
    decode.wall = decode.cpu = 0.0
    with Clock() as total:
        while batch.has_work():
            pure = batch.running == len(inputs) and all(r.status is RequestStatus.DECODING
                                                        for r in batch.scheduler.running)
            with Clock() as step:
                outputs = batch.step()
            if pure:
                decode.wall += step.wall
                decode.cpu += step.cpu
                decode_tokens += len(outputs)
            for out in outputs:
                if out.result is not None:
                    results[int(out.request.request_id)] = out.result
    generated = sum(len(r.output_ids) for r in results.values())
    return {"wall_s": total.wall, "cpu_s": total.cpu, "generated": generated,
            "tokens_per_s": generated / total.cpu, "tokens_per_s_wall": generated / total.wall,
            "decode_tokens_per_s": decode_tokens / decode.cpu if decode.cpu else None,
            "decode_tokens_per_s_wall": decode_tokens / decode.wall if decode.wall else None,
            "reserved_peak_bytes": batch.scheduler.peak_reserved_bytes,
            "kv_peak_bytes": sum(r.kv_cache_bytes_peak for r in results.values()),
            "kv_dense_bytes": sum(r.kv_cache_bytes_dense for r in results.values()),
            "outputs": [results[i].output_ids for i in range(len(inputs))]}


def run_sequential(engine: SparseEngine, inputs: list[EncodedInput], policy: Any, new_tokens: int) -> dict[str, Any]:
    outputs, decode_s, decode_tokens = [], 0.0, 0
    with Clock() as total:
        for e in inputs:
            result = engine.generate(e, policy, max_new_tokens=new_tokens, tier=0)
            outputs.append(result.output_ids)
            decode_s += result.decode_s  # wall time of the decode forwards (the engine's own timing)
            decode_tokens += len(result.output_ids) - 1
    generated = sum(len(o) for o in outputs)
    return {"wall_s": total.wall, "cpu_s": total.cpu, "generated": generated,
            "tokens_per_s": generated / total.cpu, "tokens_per_s_wall": generated / total.wall,
            "decode_tokens_per_s_wall": decode_tokens / decode_s, "outputs": outputs}


def short_prompts(engine: SparseEngine, tokenizer: Any, count: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    inputs = prompts(tokenizer, count, 250)
    dense = build_policy("dense")
    runs: dict[str, list[dict[str, Any]]] = {"batched": [], "sequential": []}
    for r in range(rounds):  # ABBA
        order = ("batched", "sequential") if r % 2 == 0 else ("sequential", "batched")
        for kind in order:
            fn = run_batch if kind == "batched" else run_sequential
            runs[kind].append(fn(engine, inputs, dense, new_tokens))
            print(f"  short {kind:10s} {runs[kind][-1]['tokens_per_s']:.1f} tok/s (cpu), "
                  f"{runs[kind][-1]['tokens_per_s_wall']:.1f} (wall)", flush=True)
    best = {k: sum(x["tokens_per_s"] for x in v) / len(v) for k, v in runs.items()}
    wall = {k: sum(x["tokens_per_s_wall"] for x in v) / len(v) for k, v in runs.items()}
    identical = all(b["outputs"] == s["outputs"] for b in runs["batched"] for s in runs["sequential"])
    decode = {k: sum(x["decode_tokens_per_s_wall"] for x in v) / len(v) for k, v in runs.items()}
    for v in runs.values():
        for x in v:
            x.pop("outputs")
    return {"prompts": count, "prompt_tokens": 250, "new_tokens": new_tokens, "rounds": runs,
            "speedup": best["batched"] / best["sequential"], "speedup_wall": wall["batched"] / wall["sequential"],
            "decode_speedup_wall": decode["batched"] / decode["sequential"],
            "answers_identical": identical}


def long_prompts(engine: SparseEngine, tokenizer: Any, count: int, tokens: int, new_tokens: int,
                 budget: int) -> dict[str, Any]:
    inputs = prompts(tokenizer, count, tokens)
    runs = {}
    for name, policy in (("dense", build_policy("dense")), ("streaming", build_policy("streaming", budget))):
        runs[name] = run_batch(engine, inputs, policy, new_tokens)
        runs[name].pop("outputs")
        print(f"  long {name:10s} decode {runs[name]['decode_tokens_per_s']:.1f} tok/s (cpu), end to end "
              f"{runs[name]['tokens_per_s']:.2f} tok/s; reserved {runs[name]['reserved_peak_bytes'] / 2**20:.0f} MiB",
              flush=True)
    d, s = runs["dense"], runs["streaming"]
    return {"prompts": count, "prompt_tokens": tokens, "new_tokens": new_tokens, "budget": budget, "runs": runs,
            "decode_speedup": s["decode_tokens_per_s"] / d["decode_tokens_per_s"],
            "decode_speedup_wall": s["decode_tokens_per_s_wall"] / d["decode_tokens_per_s_wall"],
            "end_to_end_speedup": s["tokens_per_s"] / d["tokens_per_s"],
            "kv_reserved_fraction": s["reserved_peak_bytes"] / d["reserved_peak_bytes"],
            "kv_peak_fraction": s["kv_peak_bytes"] / d["kv_peak_bytes"]}


def admission(engine: SparseEngine, tokenizer: Any, tokens: int, new_tokens: int, budget: int,
              run_tokens: int) -> dict[str, Any]:
    e = prompts(tokenizer, 1, tokens)[0]
    dense = engine.reserved_kv_bytes(e, build_policy("dense"), new_tokens)
    sparse = engine.reserved_kv_bytes(e, build_policy("streaming", budget), new_tokens)
    limit = 4 * dense
    batch = engine.batch(max_batch=256, kv_memory_limit=limit)
    for i in range(64):
        batch.add(e, build_policy("streaming", budget), GenerationOptions(max_new_tokens=new_tokens, tier=0))
    admitted = len(batch.scheduler.admit())
    # The batch running under such a limit (4 dense sequences), scaled down so the run stays short:
    # 24 prompts of ``run_tokens`` tokens, streaming budget 24, 8 new tokens.
    short = prompts(tokenizer, 24, run_tokens)
    running = engine.batch(max_batch=256, kv_memory_limit=4 * engine.reserved_kv_bytes(short[0], build_policy("dense"), 8))
    for s in short:
        running.add(s, build_policy("streaming", 24), GenerationOptions(max_new_tokens=8, tier=0))
    with Clock() as clock:
        results = running.run()
    print(f"  admission: {admitted} streaming-{budget} requests under a limit of 4 dense {tokens}-token sequences; "
          f"scaled down to {run_tokens}-token prompts and budget 24: {running.scheduler.peak_running} of 24 ran at once",
          flush=True)
    return {"limit_bytes": limit, "dense_reserved_bytes": dense, "sparse_reserved_bytes": sparse,
            "admitted_at_once": admitted, "run": {"requests": 24, "prompt_tokens": run_tokens, "budget": 24,
                                                  "peak_running": running.scheduler.peak_running,
                                                  "finished": len(results), "cpu_s": clock.cpu}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    count, long_tokens, new_tokens, rounds = (4, 1000, 16, 2) if args.quick else (8, 4000, 64, 2)
    model, tokenizer = load_model("smollm2-135m")
    engine = SparseEngine(model, tokenizer, "smollm2-135m")
    print("short prompts", flush=True)
    short = short_prompts(engine, tokenizer, count, new_tokens, rounds)
    print("long prompts", flush=True)
    long = long_prompts(engine, tokenizer, count, long_tokens, new_tokens, 512 if not args.quick else 128)
    print("admission", flush=True)
    admit = admission(engine, tokenizer, 4000, 64, 512, 300)
    targets = {
        "batched / sequential throughput, 8 x 250 tokens, dense": [short["speedup"], f">= {TARGET_BATCH}",
                                                                   short["speedup"] >= TARGET_BATCH],
        "streaming-512 / dense decode tokens/s, batched, 8 x 4000 tokens": [
            long["decode_speedup"], f">= {TARGET_SPARSE_DECODE}", long["decode_speedup"] >= TARGET_SPARSE_DECODE],
        "KV reserved streaming / dense": [long["kv_reserved_fraction"], "<= 1/6",
                                          long["kv_reserved_fraction"] <= TARGET_KV],
        "streaming-512 admitted under a limit of 4 dense 4k sequences": [
            admit["admitted_at_once"], f">= {TARGET_ADMITTED}", admit["admitted_at_once"] >= TARGET_ADMITTED],
    }
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "quick": args.quick,
           "command": command(), "source": source(), "machine": machine(),
           "threads": 1, "clock": "process cpu (wall beside it)", "targets": targets,
           "short": short, "long": long, "admission": admit}
    print(json.dumps(targets, indent=1))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
