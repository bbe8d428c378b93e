"""Does more training text make the shipped ``kvzap`` linear surrogate more faithful? Held-out fidelity by prompts.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.studies.kvzap_training_size [--traces build/shipped_policies/smollm2-135m]
        [--cases 128] [--held-out 16] [--sizes 20,32,44,56,68,80,92,102] [--out benchmarks/results/studies/kvzap_training_size.json]

The shipped SmolLM2 surrogate was fitted on 20 prompts: the training part of the first 26 traced prompts
(``python -m sparseety.training.shipped_policies --cases 26``, split as ``learn-policy`` splits). This
script reads the traces of ``--cases`` prompts of the same kind (building them as that module does when the
folder is missing, without touching the shipped weights). It holds out the last ``--held-out`` prompts (none of
the first 26). Then it fits the same ridge per layer as ``learn-policy --target kvzip`` on a growing
prefix: the shipped surrogate's 20 prompts first, then the others in order. Streamed sums make every
size one pass over the prompts. It prints and saves held-out Spearman (over token x KV head pairs) and
the recall of the true top half per KV head, averaged over the layers and prompts. The shipped file
stands beside them; its 20-prompt fit must reproduce its figures. One torch thread, about 12 minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import command

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/
TRACES = ROOT.parent / "build" / "shipped_policies" / "smollm2-135m"
OUT = ROOT / "results" / "studies" / "kvzap_training_size.json"
SHIPPED_CASES = 26


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--cases", type=int, default=128, help="prompts to trace when --traces is missing")
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--sizes", default="20,32,44,56,68,80,92,102")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    import numpy as np
    import torch

    from sparseety.training.kvzap_surrogate import (KVzapConfig, _RidgeSums, capture, kept_recall, read_contexts,
                                                    spearman)
    from sparseety.training.learned_policy import split_requests
    from sparseety.engine import SparseEngine
    from sparseety.models import DEFAULT_MODEL, load_model
    from sparseety.policies.parts.kvzap_model import Surrogate, load_surrogate
    from sparseety.policies.parts.learned_model import shipped_file

    torch.set_num_threads(1)
    model, tokenizer = load_model(DEFAULT_MODEL)
    engine = SparseEngine(model, tokenizer, DEFAULT_MODEL)
    if not args.traces.is_dir():
        from benchmarks.learned_policy_bench import build_traces

        build_traces(engine, tokenizer, args.cases, args.traces, [600, 900, 1200])
    contexts = read_contexts(args.traces, DEFAULT_MODEL)  # oldest first: case order
    first = contexts[:SHIPPED_CASES]
    train_idx, _ = split_requests(first, KVzapConfig().holdout, KVzapConfig().seed)  # type: ignore[arg-type]
    rest = contexts[SHIPPED_CASES:]
    held, order = rest[-args.held_out:], [first[i] for i in train_idx] + rest[: -args.held_out]
    sizes = sorted({n for n in (int(x) for x in args.sizes.split(",")) if n <= len(order)} | {len(order)})
    start = time.time()
    held_captures = [capture(engine, c) for c in held]
    print(f"captured {len(held)} held-out prompts ({time.time() - start:.0f} s)", flush=True)

    def fidelity(surrogate: Surrogate) -> dict[str, float]:
        rho, recall = [], []
        for captured in held_captures:
            predicted = {layer: surrogate(layer, x.unsqueeze(0))[0] for layer, (x, _) in captured.items()}
            rho.append(np.mean([spearman(predicted[layer].reshape(-1), y.reshape(-1)) for layer, (_, y) in captured.items()]))
            recall.append(np.mean([kept_recall(predicted[layer], y) for layer, (_, y) in captured.items()]))
        return {"spearman": round(float(np.mean(rho)), 4), "recall@0.5": round(float(np.mean(recall)), 4)}

    result: dict = {
        "benchmark": "kvzap_training_size",
        "command": command(),
        "model": DEFAULT_MODEL,
        "held_out_prompts": len(held),
        "shipped": {"prompts": len(train_idx), **fidelity(load_surrogate(shipped_file("kvzap-linear-", engine.model_info)))},
        "by_prompts": [],
    }
    print(f"shipped ({len(train_idx)} prompts): {result['shipped']}", flush=True)
    sums: list[_RidgeSums] = []
    for n, context in enumerate(order, start=1):
        captured = capture(engine, context)
        if not sums:
            sums = [_RidgeSums(x.shape[1], y.shape[0]) for x, y in captured.values()]
        for layer, (x, y) in captured.items():
            sums[layer].add(x, y.T)
        if n in sizes:
            solved = [s.solve(KVzapConfig().alpha) for s in sums]
            layers, d = len(solved), solved[0][0].shape[0]
            fitted = Surrogate(w1=torch.zeros(layers, d, 0), b1=torch.zeros(layers, 0),
                               w2=torch.stack([w for w, _ in solved]), b2=torch.stack([b for _, b in solved]),
                               model=DEFAULT_MODEL, model_fingerprint="")
            result["by_prompts"].append({"prompts": n, **fidelity(fitted)})
            print(f"{n:4d} prompts: {result['by_prompts'][-1]} ({time.time() - start:.0f} s)", flush=True)
    result["elapsed_s"] = round(time.time() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
