"""Decode tokens per CPU-second of ``--importance value`` and ``output`` over ``attention`` (one run, interleaved).

    .venv/bin/python -m benchmarks.importance_decode_bench [--tokens 1000] [--new 48] [--rounds 3]

A plain prompt of GPL-3 text, dense policy, tier 2, one torch thread; CPU time of the decode forwards
(``decode_s`` is wall time, so each run's process CPU time is taken around the whole generate, minus
a prefill-only run's). Writes benchmarks/results/importance_decode/importance_decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import command, machine, source
from sparseety.engine import EncodedInput, SparseEngine
from sparseety.models import load_model
from sparseety.policies import build_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")
    engine = SparseEngine(model, tokenizer, "smollm2-135m")
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, : args.tokens]

    def cpu(mode: str, new: int) -> float:
        start = time.process_time()
        engine.generate(EncodedInput(ids), build_policy("dense"), max_new_tokens=new, tier=2, importance=mode)
        return time.process_time() - start

    modes = ("attention", "value", "output")
    rates: dict[str, list[float]] = {m: [] for m in modes}
    cpu("attention", 2)  # warm-up
    for _ in range(args.rounds):
        for mode in modes:
            decode = cpu(mode, args.new) - cpu(mode, 1)  # the prefill (and first token) taken out
            rates[mode].append((args.new - 1) / decode)
    medians = {m: statistics.median(r) for m, r in rates.items()}
    result = {"tokens": args.tokens, "new": args.new, "rounds": args.rounds, "tokens_per_cpu_s": medians,
              "value_over_attention": medians["value"] / medians["attention"],
              "output_over_attention": medians["output"] / medians["attention"], "raw": rates,
              "command": command(), "source": source(), "machine": machine()}
    out = Path(__file__).parent / "results" / "importance_decode" / "importance_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
