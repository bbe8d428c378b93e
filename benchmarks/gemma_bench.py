"""Gemma 3 270M (five sliding-window layers of 512 to each global one): decode speed and KV bytes, one run.

The prompt is the first ``--context`` tokens of ``/usr/share/common-licenses/GPL-3`` (with Gemma's
BOS), greedy, ``--new-tokens`` new tokens, tier 0 (nothing recorded), one torch thread. Runs are
interleaved ABBA (dense, streaming, streaming, dense), because this 2-core machine is shared and
drifts; decode tokens/s is ``(new tokens - 1) / decode time`` on the process CPU clock (what this
process ran) and on the wall clock, pooled over both repeats. KV bytes are the engine's own
``kv_cache_bytes_peak`` (held after each step: sliding layers keep at most their window) against
``kv_cache_bytes_dense`` (what an all-global dense cache of the same length would hold).

Usage::

    .venv/bin/python -m benchmarks.gemma_bench                  # ~3,000-token prompt, 64 new tokens
    .venv/bin/python -m benchmarks.gemma_bench --context 800 --new-tokens 8    # smoke run

Saves ``benchmarks/results/gemma/gemma.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import command, machine, source
from sparseety.engine import EncodedInput, SparseEngine
from sparseety.models import GEMMA_MODEL, load_model
from sparseety.policies import build_policy

RESULTS = Path(__file__).resolve().parent / "results" / "gemma" / "gemma.json"
TEXT = Path("/usr/share/common-licenses/GPL-3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(GEMMA_MODEL)
    engine = SparseEngine(model, tokenizer, GEMMA_MODEL)
    ids = tokenizer(TEXT.read_text() * 2, return_tensors="pt").input_ids[:, : args.context]
    encoded = EncodedInput(ids)
    policies = {"dense": build_policy("dense"), f"streaming-{args.budget}": build_policy("streaming", budget=args.budget)}
    totals = {name: {"decode_cpu_s": 0.0, "decode_wall_s": 0.0, "prefill_wall_s": 0.0, "tokens": 0} for name in policies}
    outputs: dict[str, list[list[int]]] = {name: [] for name in policies}
    bytes_held: dict[str, dict[str, int]] = {}
    order = list(policies) + list(reversed(policies))
    for name in order:
        policy = policies[name]
        cpu0 = time.process_time()
        result = engine.generate(encoded, policy, max_new_tokens=args.new_tokens, tier=0)
        cpu = time.process_time() - cpu0
        share = result.decode_s / max(result.prefill_s + result.decode_s, 1e-9)  # decode's part of this run's CPU time
        row = totals[name]
        row["decode_cpu_s"] += cpu * share
        row["decode_wall_s"] += result.decode_s
        row["prefill_wall_s"] += result.prefill_s
        row["tokens"] += len(result.output_ids) - 1
        outputs[name].append(result.output_ids)
        bytes_held[name] = {"kv_cache_bytes_peak": result.kv_cache_bytes_peak,
                            "kv_cache_bytes_dense": result.kv_cache_bytes_dense}
        print(f"{name}: {len(result.output_ids)} tokens, prefill {result.prefill_s:.1f} s, decode {result.decode_s:.1f} s, "
              f"KV peak {result.kv_cache_bytes_peak / 2**20:.2f} MiB of {result.kv_cache_bytes_dense / 2**20:.2f} MiB",
              flush=True)
    figures = {}
    for name, row in totals.items():
        figures[name] = {
            "decode_tokens_per_cpu_s": row["tokens"] / row["decode_cpu_s"],
            "decode_tokens_per_wall_s": row["tokens"] / row["decode_wall_s"],
            **bytes_held[name],
            "kv_fraction_of_all_global_dense": bytes_held[name]["kv_cache_bytes_peak"] / bytes_held[name]["kv_cache_bytes_dense"],
        }
    dense, stream = figures["dense"], figures[f"streaming-{args.budget}"]
    document = {
        "model": GEMMA_MODEL, "context_tokens": encoded.input_len, "new_tokens": args.new_tokens, "budget": args.budget,
        "threads": 1, "repeats": 2, "figures": figures,
        "streaming_over_dense_decode_cpu": stream["decode_tokens_per_cpu_s"] / dense["decode_tokens_per_cpu_s"],
        "streaming_over_dense_kv": stream["kv_cache_bytes_peak"] / dense["kv_cache_bytes_peak"],
        "same_tokens_in_both_repeats": {name: runs[0] == runs[1] for name, runs in outputs.items()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command(), "source": source(), "machine": machine(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({k: v for k, v in document.items() if k != "figures"}, indent=2))
    for name, f in figures.items():
        print(f"{name}: decode {f['decode_tokens_per_cpu_s']:.2f} tok/CPU-s ({f['decode_tokens_per_wall_s']:.2f} tok/s wall), "
              f"KV {f['kv_cache_bytes_peak'] / 2**20:.2f} MiB = {f['kv_fraction_of_all_global_dense']:.3f} of all-global dense")
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
