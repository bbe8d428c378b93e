"""What the important tokens of a sampled vLLM request cost per generated token, at 1k and 4k contexts.

One ``vllm serve`` (side venv, default model, float32, eager, prefix caching on) with the observer at
sample rate 1. Requests alternate between importance on (``vllm_xargs`` ``sparseety_importance: value``)
and off for that request (``"off"``), one at a time, each with a prompt of its own (distinct first words:
no prefix-cache hits), greedy, ``--max-tokens`` tokens with EOS ignored. The figure per context is the
median of vLLM's own decode time per token (``decode_s / (outputs - 1)``, from the stored record), on
against off, and their ratio; prefill time likewise. Prints a table and saves
``benchmarks/results/vllm_importance_cost/vllm_importance_cost.json``.

    .venv/bin/python -m benchmarks.vllm_importance_cost [--contexts 1024 4096] [--repeats 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, command, machine, source
from sparseety.integrations.vllm_launcher import VLLM, VllmServer, serve_flags

BLOCK = 32

WORDS = ("river stone lamp orbit cedar violet signal harbor copper meadow lantern quartz ember falcon "
         "willow prism canyon tide glacier saffron beacon thistle cobalt marble").split()


def prompt_ids(tokenizer, seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(" ".join(rng.choice(WORDS) for _ in range(64)), add_special_tokens=False).input_ids
    return ids[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_importance_cost" / "vllm_importance_cost.json")
    args = parser.parse_args()

    if not VLLM.is_file():
        raise SystemExit(f"{VLLM} is missing: run `bash scripts/setup-vllm.sh` first")
    from transformers import AutoTokenizer

    from sparseety.models.registry import resolve_model_dir
    from sparseety.store import connect

    model = resolve_model_dir("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model)
    longest = max(args.contexts) + args.max_tokens + 64
    base = Path(tempfile.mkdtemp(prefix="sparseety-importance-cost-"))
    # the live tests' flags (tests/vllm_observer/vllm_server.py), speculative decoding off, a cache for the longest
    flags = serve_flags(prefix_caching=True, block_size=BLOCK, num_blocks=longest // BLOCK + 4, max_model_len=longest,
                        max_num_seqs=8, max_batched_tokens=2048, prompt_tokens_details=True)
    server = VllmServer(model, base / "traces", base / "vllm.log", flags=flags).start()
    print(f"vllm serve started in {server.startup_s:.1f} s (log: {base / 'vllm.log'})", flush=True)
    rows: list[dict] = []
    try:
        seed = 0
        for context in args.contexts:
            for _ in range(args.repeats):
                for mode in ("off", "value"):
                    seed += 1
                    ids = prompt_ids(tokenizer, seed, context)
                    response = server.complete(ids, args.max_tokens, ignore_eos=True,
                                               vllm_xargs={"sparseety_importance": mode})
                    rows.append({"context": context, "mode": mode, "prompt": ids,
                                 "output": response["choices"][0]["token_ids"]})
                    print(f"  {context} {mode} done", flush=True)
        time.sleep(8)
        con = connect(server.trace_dir)
        stored = con.sql("SELECT prompt_token_ids, output_token_ids, extra_json FROM requests "
                         "WHERE policy = 'vllm'").fetchall()
    finally:
        server.stop()
    by_prompt = {tuple(p): json.loads(e)["vllm"] for p, _, e in stored if p}
    table = []
    for context in args.contexts:
        figures = {}
        for mode in ("off", "value"):
            infos = [by_prompt[tuple(r["prompt"])] for r in rows if r["context"] == context and r["mode"] == mode]
            decode = [i["timings"]["decode_s"] / (args.max_tokens - 1) for i in infos]
            prefill = [i["timings"]["prefill_s"] for i in infos]
            status = [i.get("importance", {}).get("status") for i in infos]
            figures[mode] = {"decode_ms_per_token": 1000 * statistics.median(decode),
                             "prefill_s": statistics.median(prefill), "importance": status,
                             "decode_ms_each": [round(1000 * d, 2) for d in decode]}
        on, off = figures["value"], figures["off"]
        table.append({"context": context, **figures,
                      "decode_ratio": on["decode_ms_per_token"] / off["decode_ms_per_token"],
                      "decode_extra_ms_per_token": on["decode_ms_per_token"] - off["decode_ms_per_token"],
                      "prefill_ratio": on["prefill_s"] / off["prefill_s"]})
    print(f"\n{'context':>8} {'off ms/tok':>11} {'value ms/tok':>13} {'ratio':>6} {'extra ms/tok':>13} {'prefill ratio':>14}")
    for t in table:
        print(f"{t['context']:>8} {t['off']['decode_ms_per_token']:>11.2f} {t['value']['decode_ms_per_token']:>13.2f} "
              f"{t['decode_ratio']:>6.3f} {t['decode_extra_ms_per_token']:>13.2f} {t['prefill_ratio']:>14.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command(), "max_tokens": args.max_tokens, "repeats": args.repeats,
                                    "results": table, "source": source(), "machine": machine()}, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
