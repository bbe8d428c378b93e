"""vLLM throughput with SparSEEty's observer against vLLM without it, side by side in one run.

Two ``vllm serve`` processes from the side venv (``scripts/setup-vllm.sh``) run at once on the default
model, with the same flags (prefix caching and KV-cache events on in both): one with every plugin
disabled (``VLLM_PLUGINS=""``), one with the observer writing a tier-1 row for every request and its
tier-2 trace for 5% (``SPARSEETY_SAMPLE_RATE=0.05``). Rounds alternate between them, only one loaded at a
time, so load from other processes falls on both alike; each round sends the same distinct prompts from
several concurrent clients and counts generated tokens per wall-clock second. The figure is the ratio of
the medians (target >= 0.97).

    .venv/bin/python -m benchmarks.vllm_observer_bench [--rounds 4] [--requests 16] [--concurrency 4]
        [--model smollm2-135m] [--out benchmarks/results/vllm_observer/vllm_observer.json]

``--model`` takes a built-in name (``smollm2-moe``: the MoE model, whose every request's expert routing is
then counted, and the 5% sampled requests' routing captured too; ``gemma3-270m`` with ``--prompt-words 500``:
prompts past its 512-token window, so every request's window rows and frees are recorded; the result then
goes to ``vllm_observer_<model>.json`` unless ``--out`` says otherwise).

With the worker's importance capture on (tier 2, ``SPARSEETY_IMPORTANCE`` default ``value``), the sampled
requests also get their important tokens: the issue's "tier 1 for all plus importance for 5% sampled".
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import ROOT, command, machine, source
from sparseety.integrations.vllm_launcher import VLLM, VllmServer, serve_flags

WORDS = "river stone lamp orbit cedar violet signal harbor copper meadow lantern quartz ember falcon".split()


def launch_side(model: str, name: str, env: dict[str, str], log_dir: Path) -> VllmServer:
    """One side's ``vllm serve`` (prefix caching and KV-cache events on), launched and not yet waited for."""
    return VllmServer(model, None, log_dir / f"{name}.log", flags=serve_flags(prefix_caching=True, max_model_len=2048),
                      extra_env=env, name=name).launch()


def one_round(server: VllmServer, prompts: list[str], max_tokens: int, concurrency: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda p: server.completion_tokens(p, max_tokens), prompts))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-rate", type=float, default=0.05)
    parser.add_argument("--prompt-words", type=int, default=150,
                        help="words per prompt (gemma3-270m: 500, about 650 tokens, past its 512-token window)")
    parser.add_argument("--model", default="smollm2-135m", help="built-in model name (e.g. smollm2-moe)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not VLLM.is_file():
        raise SystemExit(f"{VLLM} is missing: run `bash scripts/setup-vllm.sh` first")
    from sparseety.models.registry import resolve_model_dir

    model = resolve_model_dir(args.model)
    suffix = "" if args.model == "smollm2-135m" else f"_{args.model}"
    out = args.out or ROOT / "benchmarks" / "results" / "vllm_observer" / f"vllm_observer{suffix}.json"
    work = Path(tempfile.mkdtemp(prefix="vllm-observer-bench-"))
    off = launch_side(model, "off", {"VLLM_PLUGINS": ""}, work)
    on = launch_side(model, "observer", {"SPARSEETY_TRACE_DIR": str(work / "traces"), "SPARSEETY_TIER": "2",
                                         "SPARSEETY_SAMPLE_RATE": str(args.sample_rate)}, work)
    try:
        off.wait_ready()
        on.wait_ready()
        rates: dict[str, list[float]] = {"off": [], "observer": []}
        for round_index in range(args.rounds + 1):  # round 0 warms both up and is not counted
            rng = random.Random(round_index)
            prompts = [f"Round {round_index} note {i}: " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                       for i in range(args.requests)]
            order = (off, on) if round_index % 2 == 0 else (on, off)
            for server in order:
                # each server sees each round's prompts once: no prefix-cache hits from a previous round
                rate = one_round(server, [f"[{server.name}] {p}" for p in prompts], args.max_tokens,
                                 args.concurrency)
                if round_index:
                    rates[server.name].append(rate)
                    print(f"round {round_index} {server.name:8s} {rate:7.1f} tokens/s", flush=True)
        med = {k: statistics.median(v) for k, v in rates.items()}
        ratio = med["observer"] / med["off"]
        result = {"model": args.model, "off_tokens_per_s": round(med["off"], 1), "observer_tokens_per_s": round(med["observer"], 1),
                  "ratio": round(ratio, 3), "target": 0.97, "rounds": args.rounds,
                  "requests": args.requests, "concurrency": args.concurrency,
                  "max_tokens": args.max_tokens, "sample_rate": args.sample_rate, "prompt_words": args.prompt_words,
                  "per_round": {k: [round(r, 1) for r in v] for k, v in rates.items()},
                  "command": command(), "source": source(), "machine": machine()}
        print(json.dumps(result))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        on.stop()
        off.stop()


if __name__ == "__main__":
    main()
