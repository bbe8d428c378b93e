"""What kvpress's per-head KVzip budgets would cost in a cache that holds one slot count per layer.

``KVzipPress`` keeps a global top-k over (layer, KV head, position) of the reconstruction scores and
masks the rest, so each head keeps its own count (and kvpress holds every slot). ``kvzip`` here shares
the budget across layers by score, but every KV head of a layer keeps the same count, because the
cache stores a layer as one ``[b, kv_heads, slots, d]`` tensor and really frees what it evicts.

For each passkey case this runs ``kvzip``'s scoring (the engine's own reconstruction pass, through the
policy's ``allocate`` hook), then computes, from those very scores, the per-head counts kvpress's rule
would choose and the memory a per-layer tensor would need to hold them: each layer padded to its
busiest head's count. That is the memory at which the per-head choice could be run with this cache's
layout; the evicting per-layer choice holds the budget itself.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.studies.kvzip_head_budgets [--lengths 1000,1500,2000] [--depths 0.1,0.5,0.9]
                                                      [--seed 0] [--ratios 0.5,0.75]

Saves ``benchmarks/results/studies/kvzip_head_budgets.json``. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import command

RESULTS = Path(__file__).resolve().parents[1] / "results" / "studies" / "kvzip_head_budgets.json"


def head_counts(scores: dict[int, torch.Tensor], budgets: dict[int, int]) -> torch.Tensor:
    """``[layers, kv_heads]`` slots each head keeps under one top-k over (layer, head, position) of ``scores``
    (each ``[1, kv_heads, n]``) with the same total as ``budgets``."""
    stacked = torch.stack([scores[layer][0].float() for layer in sorted(scores)])  # [L, H, n]
    layers, heads, n = stacked.shape
    total = sum(budgets.values()) * heads
    keep = torch.zeros(stacked.numel(), dtype=torch.bool)
    keep[torch.topk(stacked.reshape(-1), total).indices] = True
    return keep.view(layers, heads, n).sum(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1000,1500,2000")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from sparseety.suites import make_cases, tokenizer_counter
    from sparseety.suites.passkey_run import answer_case
    from sparseety.engine import SparseEngine
    from sparseety.models import DEFAULT_MODEL, load_model
    from sparseety.policies.kvzip import KVzipPolicy

    lm, tokenizer = load_model(DEFAULT_MODEL)
    engine = SparseEngine(lm, tokenizer, DEFAULT_MODEL)
    shared = KVzipPolicy.allocate
    seen: list[tuple[torch.Tensor, dict[int, int], int]] = []

    def spy(self: KVzipPolicy, scores: dict[int, torch.Tensor], budgets: dict[int, int]) -> dict[int, int]:
        seen.append((head_counts(scores, budgets), budgets, next(iter(scores.values())).shape[-1]))
        return shared(self, scores, budgets)

    KVzipPolicy.allocate = spy  # type: ignore[method-assign]
    rows = []
    cases = make_cases([int(x) for x in args.lengths.split(",")], [float(x) for x in args.depths.split(",")],
                       args.seed, tokenizer_counter(tokenizer))
    for ratio in (float(x) for x in args.ratios.split(",")):
        for case in cases:
            answer_case(engine, case, "kvzip", ratio, max_new_tokens=1)
            counts, budgets, n = seen.pop()
            layers = counts.shape[0]
            rows.append({"ratio": ratio, "length": case.length, "depth": case.depth, "context_slots": n,
                         "budget_fraction": round(sum(budgets.values()) / (layers * n), 4),
                         "padded_fraction": round(int(counts.amax(dim=-1).sum()) / (layers * n), 4),
                         "head_count_min": int(counts.min()), "head_count_max": int(counts.max())})
            print(json.dumps(rows[-1]), flush=True)
    summary = {str(r): {key: round(statistics.mean(x[key] for x in rows if x["ratio"] == r), 4)
                        for key in ("budget_fraction", "padded_fraction")} for r in dict.fromkeys(x["ratio"] for x in rows)}
    argv = ["--lengths", args.lengths, "--depths", args.depths, "--seed", str(args.seed), "--ratios", args.ratios]
    args.out.write_text(json.dumps({"model": DEFAULT_MODEL, "command": command(argv), "summary": summary, "rows": rows},
                                   indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
