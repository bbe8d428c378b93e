"""Extractor speed: a prefill attention tensor and a decode step, against a naive loop and bare topk.

Run: ``.venv/bin/python -m benchmarks.extract_bench``; prints the figures and saves them to
``benchmarks/results/extract/extract.json``.

- extractor: :func:`sparseety.extract.extract` with the default config (mean over heads, sum over
  query rows, max-normalized, top 16, min_score 0.05), records built.
- bare topk: the same reduction ops the extractor runs (matrix products with a ones vector) and
  ``torch.topk`` on the result; no checks, no exact ties, no records. Its ratio is the extractor's
  overhead.
- plain torch (for context): ``x.sum(query).mean(heads)`` and ``torch.topk``, as one would write it.
- naive loop: a first prototype: the tensor as Python lists, per-token scores accumulated in Python
  loops, a full argsort (``sorted``) per ranking, records as dicts. On the prefill tensor it runs on
  a subset of query rows and is extrapolated linearly in the number of elements (the output says so).
- numpy per ranking (for context): vectorized NumPy reductions and ``np.argsort`` per ranking.

Rounds alternate the contenders and report medians, so a busy machine skews them alike. Each
workload runs with torch's default intra-op threads and with one thread: on a small shared machine,
thread wake-ups can dominate ops this small.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import command, machine, source
from sparseety.config import ExtractionConfig
from sparseety.extract import extract

CONFIG = ExtractionConfig()
RESULTS = Path(__file__).parent / "results" / "extract" / "extract.json"
ROUNDS = 7


def naive_ranking(token_ids: list[int], attention: list, k: int, min_score: float) -> list[dict]:
    """First-prototype extraction of one ranking from ``[heads][queries][keys]`` nested lists."""
    heads, n = len(attention), len(attention[0][0])
    scores = [0.0] * n
    for head in attention:
        for row in head:
            for j in range(n):
                scores[j] += row[j] / heads
    top = max(scores)
    scores = [s / top for s in scores]
    order = sorted(range(n), key=lambda j: -scores[j])  # argsort of the whole ranking
    records = []
    for rank, j in enumerate(order[:k]):
        if scores[j] >= min_score:
            records.append({"token_id": token_ids[j], "position": j, "score": scores[j], "rank": rank})
    return records


def numpy_ranking(token_ids: list[int], attention: np.ndarray, k: int, min_score: float) -> list[dict]:
    """A vectorized NumPy prototype of one ranking from ``[heads, queries, keys]``."""
    scores = attention.sum(axis=1).mean(axis=0)
    scores = scores / scores.max()
    order = np.argsort(-scores, kind="stable")[:k]
    return [
        {"token_id": token_ids[j], "position": int(j), "score": float(scores[j]), "rank": rank}
        for rank, j in enumerate(order)
        if scores[j] >= min_score
    ]


def seconds(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def race(contenders: dict[str, tuple[Callable[[], object], int]]) -> dict[str, float]:
    """Median seconds per call of each contender over alternating rounds."""
    for fn, _ in contenders.values():
        fn()  # warm up
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(ROUNDS):
        for name, (fn, repeat) in contenders.items():
            times[name].append(seconds(fn, repeat))
    return {name: statistics.median(values) for name, values in times.items()}


def bare_topk(x: torch.Tensor) -> torch.return_types.topk:
    """``[heads, queries, keys]`` -> top keys by the extractor's reduction, with nothing else."""
    heads, queries = x.shape[0], x.shape[1]
    per_head = x[:, 0] if queries == 1 else torch.matmul(x.new_ones(1, queries), x)[:, 0]
    return torch.topk(torch.matmul(per_head.new_ones(1, heads), per_head) / heads, CONFIG.top_k)


def softmax_rows(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=generator) * 2, dim=-1)


def prefill() -> dict:
    x = softmax_rows(1, 9, 2048, 2048, seed=0)
    ids = list(range(2048))
    subset_rows = 32
    subset = x[0, :, :subset_rows].tolist()
    records = extract(ids, x, CONFIG)
    t = race(
        {
            "extractor": (lambda: extract(ids, x, CONFIG), 5),
            "bare_topk": (lambda: bare_topk(x[0]), 5),
            "plain_torch": (lambda: torch.topk(x[0].sum(1).mean(0), CONFIG.top_k), 5),
            "numpy_per_ranking": (lambda: numpy_ranking(ids, x[0].numpy(), CONFIG.top_k, CONFIG.min_score), 2),
        }
    )
    naive_subset = min(seconds(lambda: naive_ranking(ids, subset, CONFIG.top_k, CONFIG.min_score), 1) for _ in range(3))
    to_lists = min(seconds(lambda: x[0, :, :subset_rows].tolist(), 1) for _ in range(3))
    scale = x.shape[2] / subset_rows
    t["naive_loop"] = (naive_subset + to_lists) * scale
    return summary(
        "prefill attention [1, 9, 2048, 2048] float32",
        t,
        len(records),
        f"naive loop measured on {subset_rows} of 2048 query rows (incl. .tolist()) and extrapolated x{scale:.0f}",
    )


def decode_step() -> dict:
    layers = [softmax_rows(9, 1, 8192, seed=layer) for layer in range(30)]
    ids = list(range(8192))
    arrays = [layer.numpy() for layer in layers]
    records = sum(len(extract(ids, layer, CONFIG, layer=i)) for i, layer in enumerate(layers))
    t = race(
        {
            "extractor": (lambda: [extract(ids, layer, CONFIG, layer=i) for i, layer in enumerate(layers)], 10),
            "bare_topk": (lambda: [bare_topk(layer) for layer in layers], 10),
            "plain_torch": (lambda: [torch.topk(layer[:, 0].mean(0), CONFIG.top_k) for layer in layers], 10),
            "numpy_per_ranking": (lambda: [numpy_ranking(ids, a, CONFIG.top_k, CONFIG.min_score) for a in arrays], 3),
            "naive_loop": (
                lambda: [naive_ranking(ids, layer.tolist(), CONFIG.top_k, CONFIG.min_score) for layer in layers],
                1,
            ),
        }
    )
    return summary(
        "decode step, 30 layers x [9, 1, 8192] float32", t, records, "naive loop measured in full (incl. .tolist())"
    )


def summary(name: str, t: dict[str, float], records: int, note: str) -> dict:
    return {
        "workload": name,
        "records": records,
        "seconds": t,
        "records_per_second": records / t["extractor"],
        "speedup_vs_naive_loop": t["naive_loop"] / t["extractor"],
        "speedup_vs_numpy_per_ranking": t["numpy_per_ranking"] / t["extractor"],
        "slowdown_vs_bare_topk": t["extractor"] / t["bare_topk"],
        "slowdown_vs_plain_torch": t["extractor"] / t["plain_torch"],
        "note": note,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options; --help says what it is
    default_threads = torch.get_num_threads()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    results = {
        "command": command(),
        "source": source(),
        "targets": {"speedup_vs_naive_loop": ">= 20", "slowdown_vs_bare_topk": "<= 3"},
        "runs": [],
    }
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        for run in (prefill(), decode_step()):
            run["torch_threads"] = threads
            run["meets_targets"] = run["speedup_vs_naive_loop"] >= 20 and run["slowdown_vs_bare_topk"] <= 3
            results["runs"].append(run)
            report(run)
    torch.set_num_threads(default_threads)
    results["machine"] = machine(load_average_at_start=load_at_start)
    print(f"load average {results['machine']['load_average'][0]:.2f} on {results['machine']['cpus']} cores")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {RESULTS}")


def report(run: dict) -> None:
    s, ms = run["seconds"], {name: f"{value * 1e3:9.3f} ms" for name, value in run["seconds"].items()}
    print(f"{run['workload']}, {run['torch_threads']} torch thread(s): {run['records']} records")
    print(f"  extractor          {ms['extractor']}   {run['records_per_second']:,.0f} records/s")
    print(f"  bare topk          {ms['bare_topk']}   extractor/bare {run['slowdown_vs_bare_topk']:.2f}x (target <= 3)")
    print(
        f"  naive loop         {ms['naive_loop']}   naive/extractor {run['speedup_vs_naive_loop']:.0f}x (target >= 20)"
    )
    print(f"  plain torch        {ms['plain_torch']}   extractor/plain {run['slowdown_vs_plain_torch']:.2f}x (context)")
    numpy_ratio = s["numpy_per_ranking"] / s["extractor"]
    print(f"  numpy per ranking  {ms['numpy_per_ranking']}   numpy/extractor {numpy_ratio:.1f}x (context)")
    print(f"  {run['note']}; targets {'met' if run['meets_targets'] else 'MISSED'}")


if __name__ == "__main__":
    main()
