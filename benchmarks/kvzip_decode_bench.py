"""kvzip decode speed against ``streaming``'s, in blocks of decode steps interleaved on live sequences.

``kvzip_bench.py`` times whole generations, so its decode figure rests on 48 steps per run taken
minutes apart (a 7k-token kvzip prefill takes two minutes here), and this shared 2-core machine drifts
by more than the margin in between (``streaming`` ran at 52 and 79 ms/token in consecutive rounds).
Here each sequence is prefilled once (``streaming``, ``kvzip`` with its per-head counts, the default,
and ``kvzip`` with ``per_head=false``), then the three take turns: ``--block`` decode steps each, in
ABC CBA order, for ``--rounds`` rounds, each step feeding the sequence's own greedy token. Every
sequence stays at its budget (one slot per head evicted per step), so each block measures the same
steady state. Decode tokens/s is ``1 / median(step)`` over all of a sequence's steps, on the process
CPU clock (one torch thread).

Target (issue 15): kvzip decode tokens/s at budget 1024 on ~7k tokens >= 0.9 x streaming's.

Usage::

    .venv/bin/python -m benchmarks.kvzip_decode_bench               # 7k context, budget 1024 (~8 min)
    .venv/bin/python -m benchmarks.kvzip_decode_bench --context 2000 --budget 512 --rounds 4
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import command, machine, source
from sparseety.engine import EncodedInput, SparseEngine, encode_prompt
from sparseety.engine.context import activate
from sparseety.models import load_model
from sparseety.policies import build_policy

RESULTS = Path(__file__).resolve().parent / "results" / "kvzip_decode" / "kvzip_decode.json"
TEXT = Path("/usr/share/common-licenses/GPL-3")
TARGET_DECODE = 0.9
RUNS = {"streaming": ("streaming", None), "kvzip": ("kvzip", {"per_head": "true"}),
        "kvzip_shared": ("kvzip", {"per_head": "false"})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--block", type=int, default=8, help="decode steps per turn")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine = SparseEngine(model, tokenizer, args.model)
    ids = encode_prompt(tokenizer, TEXT.read_text(), chat=False).input_ids[:, : args.context]
    encoded = EncodedInput(ids)
    started = time.perf_counter()
    live: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for label, (name, options) in RUNS.items():  # prefill each sequence once (kvzip: and its pass)
            run = engine.open_run(encoded, build_policy(name, args.budget, options), tier=1)
            ctx = run.__enter__()
            logits = model(input_ids=encoded.input_ids, past_key_values=ctx.cache, use_cache=True,
                           logits_to_keep=1).logits
            if ctx.reconstruction.pending:
                engine.reconstruct(ctx, encoded)
            live[label] = {"run": run, "ctx": ctx, "next": logits[:, -1:].argmax(-1), "steps": [],
                           "held_bytes": ctx.cache.nbytes()}
            print(f"prefilled {label}: {ctx.cache.nbytes()} KV bytes held", flush=True)
        for r in range(args.rounds):
            for label in (list(live) if r % 2 == 0 else list(live)[::-1]):
                seq = live[label]
                with activate(seq["ctx"]):
                    for _ in range(args.block):
                        t = time.process_time()
                        logits = model(input_ids=seq["next"], past_key_values=seq["ctx"].cache, use_cache=True).logits
                        seq["next"] = logits[:, -1:].argmax(-1)
                        seq["steps"].append(time.process_time() - t)
            print(f"round {r}: " + ", ".join(f"{label} {1e3 * statistics.median(s['steps'][-args.block:]):.1f} ms"
                                             for label, s in live.items()), flush=True)
    speed = {label: 1.0 / statistics.median(s["steps"]) for label, s in live.items()}
    ratios = {label: speed[label] / speed["streaming"] for label in speed if label != "streaming"}
    report = {
        "benchmark": "kvzip_decode_bench", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command(), "source": source(), "machine": machine(),
        "model": args.model, "context": encoded.input_len, "budget": args.budget, "block": args.block,
        "rounds": args.rounds, "clock": "process cpu",
        "target": {"kvzip_decode_over_streaming_min": TARGET_DECODE},
        "decode_tokens_per_s": speed, "over_streaming": ratios,
        "met": ratios["kvzip"] >= TARGET_DECODE,
        "kv_bytes_held_after_prefill": {label: s["held_bytes"] for label, s in live.items()},
        "kv_bytes_held_at_end": {label: s["ctx"].cache.nbytes() for label, s in live.items()},
        "steps_s": {label: s["steps"] for label, s in live.items()},
        "elapsed_wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print("decode tokens/s " + ", ".join(f"{k} {v:.2f}" for k, v in speed.items()))
    print("over streaming " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f" (target >= {TARGET_DECODE}); wrote {args.out}")


if __name__ == "__main__":
    main()
