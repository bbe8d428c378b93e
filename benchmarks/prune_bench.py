"""Token-pruning benchmark: time to first token with ``--prune-schedule 8:0.5`` against dense, and fidelity.

The prompt is the first ``--context`` tokens (default 4000) of ``/usr/share/common-licenses/GPL-3``,
encoded as a plain prompt (no chat template). Time to first token is one ``engine.generate(...,
max_new_tokens=1)`` call (prefill plus choosing the first token), timed on the process CPU clock with one
torch thread (the wall clock is recorded beside it; see decode_bench.py for why on this shared 2-core
machine). Dense and pruned runs are interleaved ABBA over ``--repeats`` rounds in one process; the
figure is the ratio of medians. Target (issue 8): pruned TTFT at least 1.4x faster than dense.

Fidelity, as ``sparseety compare`` measures it: both runs teacher-forced along the dense run's first
``--new-tokens`` greedy tokens (``sparseety.analysis.fidelity``): mean/max KL(dense || pruned), top-1
agreement, perplexities; plus the free-running greedy outputs' agreement and first divergence.

Usage::

    .venv/bin/python -m benchmarks.prune_bench             # ~5 min on this machine
    .venv/bin/python -m benchmarks.prune_bench --repeats 1 --context 2000   # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import command, machine, source
from sparseety.engine import EncodedInput, SparseEngine, encode_prompt
from sparseety.models import load_model
from sparseety.policies import build_policy
from sparseety.prune_schedule import PruneSchedule, parse_prune_schedule

RESULTS = Path(__file__).resolve().parent / "results" / "prune" / "prune.json"
TEXT = Path("/usr/share/common-licenses/GPL-3")
TARGET_TTFT_SPEEDUP = 1.4


def ttft(engine: SparseEngine, encoded: EncodedInput, schedule: PruneSchedule | None) -> dict[str, Any]:
    """One time-to-first-token measurement on both clocks."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = engine.generate(encoded, build_policy("dense"), max_new_tokens=1, tier=1, prune=schedule)
    return {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
            "first_token": result.output_ids[0], "kv_cache_bytes_peak": result.kv_cache_bytes_peak,
            "pruned_tokens": result.pruned_tokens, "layer_tokens": result.arrays["layer_tokens"].tolist()
            if "layer_tokens" in result.arrays else None}


def teacher_forced(engine: SparseEngine, encoded: EncodedInput, schedule: PruneSchedule | None,
                   targets: list[int]) -> torch.Tensor:
    """``[steps, vocab]`` log-probabilities along ``targets`` (the loop of ``analysis.fidelity``, with pruning)."""
    rows = []
    with engine.open_run(encoded, build_policy("dense"), tier=1, prune=schedule) as ctx:
        out = engine.model(input_ids=encoded.input_ids, past_key_values=ctx.cache, use_cache=True, logits_to_keep=1)
        rows.append(out.logits[0, -1])
        for token in targets[:-1]:
            out = engine.model(input_ids=torch.tensor([[token]]), past_key_values=ctx.cache, use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(rows).double(), dim=-1)


def fidelity_figures(engine: SparseEngine, encoded: EncodedInput, schedule: PruneSchedule, new_tokens: int) -> dict[str, Any]:
    from sparseety.analysis.fidelity import fidelity

    dense = engine.generate(encoded, build_policy("dense"), max_new_tokens=new_tokens, tier=1)
    pruned = engine.generate(encoded, build_policy("dense"), max_new_tokens=new_tokens, tier=1, prune=schedule)
    targets = dense.output_ids
    fid = fidelity(teacher_forced(engine, encoded, None, targets), teacher_forced(engine, encoded, schedule, targets),
                   targets).to_dict()
    diverge = next((i for i, (a, b) in enumerate(zip(dense.output_ids, pruned.output_ids)) if a != b), None)
    return {
        "teacher_forced": {k: (round(v, 5) if isinstance(v, float) else [round(x, 5) for x in v]) for k, v in fid.items()},
        "free_running_token_agreement": sum(a == b for a, b in zip(dense.output_ids, pruned.output_ids)) / len(targets),
        "first_divergence": diverge,
        "dense_text": dense.text, "pruned_text": pruned.text,
        "kv_cache_bytes_peak": {"dense": dense.kv_cache_bytes_peak, "pruned": pruned.kv_cache_bytes_peak},
        "pruned_tokens": pruned.pruned_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=4000, help="prompt tokens (default 4000)")
    parser.add_argument("--schedule", default="8:0.5", help="prune schedule (default 8:0.5)")
    parser.add_argument("--repeats", type=int, default=2, help="ABBA rounds (default 2: 4 runs per arm)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens compared for fidelity (default 16)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    model, tokenizer = load_model(args.model)
    engine = SparseEngine(model, tokenizer, args.model)
    ids = encode_prompt(tokenizer, TEXT.read_text(), chat=False).input_ids
    if ids.shape[1] < args.context:
        raise SystemExit(f"{TEXT} has only {ids.shape[1]} tokens; --context {args.context} is too long")
    encoded = EncodedInput(ids[:, : args.context])
    schedule = parse_prune_schedule(args.schedule)
    print(f"prompt: first {args.context} tokens of {TEXT}; schedule {schedule.text()}; threads {torch.get_num_threads()}",
          flush=True)

    print("warm-up (not recorded)", flush=True)
    warm = EncodedInput(ids[:, :256])
    ttft(engine, warm, None)
    ttft(engine, warm, schedule)

    arms: dict[str, PruneSchedule | None] = {"dense": None, "pruned": schedule}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for r in range(args.repeats):
        order = list(arms) + list(reversed(arms))  # ABBA within each round
        for name in order:
            m = ttft(engine, encoded, arms[name])
            m["load_1min"] = os.getloadavg()[0]
            runs[name].append(m)
            print(f"  round {r + 1} {name:7s} ttft cpu {m['cpu_s']:6.2f} s  wall {m['wall_s']:6.2f} s  "
                  f"first token {m['first_token']}  kv {m['kv_cache_bytes_peak'] / 2**20:.1f} MiB", flush=True)

    med = {name: {clock: statistics.median(m[f"{clock}_s"] for m in ms) for clock in ("cpu", "wall")}
           for name, ms in runs.items()}
    speedup_cpu = med["dense"]["cpu"] / med["pruned"]["cpu"]
    speedup_wall = med["dense"]["wall"] / med["pruned"]["wall"]
    print(f"TTFT median: dense {med['dense']['cpu']:.2f} s, pruned {med['pruned']['cpu']:.2f} s (cpu clock) -> "
          f"{speedup_cpu:.2f}x (wall {speedup_wall:.2f}x); target >= {TARGET_TTFT_SPEEDUP}x", flush=True)

    print(f"fidelity: {args.new_tokens} tokens, teacher-forced along dense", flush=True)
    fid = fidelity_figures(engine, encoded, schedule, args.new_tokens)
    print(f"  mean KL {fid['teacher_forced']['mean_kl']:.4f} nats, max KL {fid['teacher_forced']['max_kl']:.4f}, "
          f"top-1 agreement {fid['teacher_forced']['top1_agreement']:.3f}, ppl dense {fid['teacher_forced']['ppl_dense']:.3f} "
          f"vs pruned {fid['teacher_forced']['ppl_sparse']:.3f}; free-running agreement "
          f"{fid['free_running_token_agreement']:.3f} (first divergence {fid['first_divergence']})", flush=True)

    res = {
        "benchmark": "prune_bench",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command(),
        "source": source(),
        "machine": machine(),
        "setup": {"model": args.model, "text": str(TEXT), "chat_template": False, "context": args.context,
                  "schedule": schedule.params(), "repeats": args.repeats, "order": "ABBA rounds",
                  "ttft": "engine.generate(max_new_tokens=1, tier=1), policy dense, median over runs",
                  "clock": "cpu (process time) primary, wall recorded"},
        "targets": {"ttft_speedup": {"value": round(speedup_cpu, 4), "target": f">= {TARGET_TTFT_SPEEDUP}",
                                     "pass": speedup_cpu >= TARGET_TTFT_SPEEDUP,
                                     "what": f"dense TTFT / {schedule.text()} TTFT @ {args.context} tokens, cpu clock"}},
        "figures": {"ttft_s_median": med, "ttft_speedup_wall": round(speedup_wall, 4),
                    "kv_peak_ratio_first_token": round(runs["pruned"][0]["kv_cache_bytes_peak"]
                                                       / runs["dense"][0]["kv_cache_bytes_peak"], 4),
                    "layer_tokens_pruned": runs["pruned"][0]["layer_tokens"],
                    "first_token_equal": all(m["first_token"] == runs["dense"][0]["first_token"]
                                             for m in runs["dense"] + runs["pruned"]),
                    "fidelity": fid},
        "total_s": round(time.perf_counter() - t_start, 1),
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {args.output} ({res['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
