"""Eviction inside vLLM's paged KV cache against dense vLLM, side by side in one run (issue 40's figures).

Two ``vllm serve`` processes of the side venv on the default model, one after the other, with the same flags and
the same KV cache of ``N x ceil((prompt + new) / 32)`` blocks of 32 tokens (prefix caching off, so neither side
reads another request's prompt): dense, and ``SPARSEETY_KV_POLICY=streaming SPARSEETY_KV_BUDGET=512``.

- **Capacity and throughput**: ``--requests`` distinct prompts of ``--prompt`` tokens (license texts that ship on
  the machine) ask ``--new`` tokens each, all at once; vLLM's ``vllm:num_requests_running`` is read every 0.25 s
  (the most at once; target: evicting >= 4N) and output tokens per wall second are counted (target >= 1.5x dense).
- **Decode on a long prompt**: one ``--long``-token prompt at ``--long-budget`` (``sparseety_budget`` of
  ``vllm_xargs``), decode tokens per second from two requests (1 and ``1 + --decode`` new tokens: the difference
  is decode alone; target >= 1.3x dense).
- **Prefill with kvzap**: the ``--long`` prompt with one new token (time to the first token: the prefill, whose
  forwards run kvzap's surrogate on every layer's attention input), asked per request
  (``sparseety_policy=kvzap``) on the evicting server, against the same request on dense vLLM; the median of
  ``--repeats`` (target <= 1.10x dense). The first compaction runs at the next step, in the decode figures.

    .venv/bin/python -m benchmarks.vllm_eviction_bench [--n 2] [--requests 10] [--prompt 4096] [--new 256]
        [--long 7000] [--long-budget 1024] [--decode 128] [--repeats 3] [--out benchmarks/results/vllm_eviction/vllm_eviction.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import ROOT, command, machine, source
from sparseety.integrations.vllm_launcher import VLLM, VllmServer, serve_flags

BLOCK = 32
LICENSES = Path("/usr/share/common-licenses")


def token_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` token ids from the license texts (each from its own offset)."""
    text = "\n\n".join((LICENSES / name).read_text() for name in sorted(os.listdir(LICENSES))
                       if (LICENSES / name).is_file())
    ids = tokenizer(text)["input_ids"]
    step = max(1, (len(ids) - length) // max(1, count))
    if len(ids) < length + count:
        raise SystemExit(f"the license texts hold {len(ids)} tokens: too few for {count} prompts of {length}")
    return [ids[i * step: i * step + length] for i in range(count)]


def load(server: VllmServer, prompts: list[list[int]], new: int) -> dict[str, float]:
    """All ``prompts`` at once: the most requests vLLM ran at once, and output tokens per wall second."""
    peak, stop = [0.0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], server.metrics().get("vllm:num_requests_running", 0.0))
            except OSError:
                pass
            stop.wait(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(lambda p: server.completion_tokens(p, new), prompts))
    wall = time.perf_counter() - start
    stop.set()
    watcher.join()
    return {"running_peak": peak[0], "output_tokens": tokens, "wall_s": round(wall, 2),
            "output_tokens_per_s": round(tokens / wall, 3)}


def decode_rate(server: VllmServer, prompt: list[int], decode: int, xargs: dict | None) -> dict[str, float]:
    """Decode tokens per second of one request on ``prompt`` (two requests: 1 and ``1 + decode`` new tokens)."""
    timed = []
    for new in (1, 1 + decode):
        start = time.perf_counter()
        server.completion_tokens(prompt, new, xargs)
        timed.append(time.perf_counter() - start)
    return {"prefill_s": round(timed[0], 3), "decode_s": round(timed[1] - timed[0], 3),
            "decode_tokens_per_s": round(decode / (timed[1] - timed[0]), 3)}


def prefill_time(server: VllmServer, prompt: list[int], repeats: int, xargs: dict | None) -> dict[str, object]:
    """Seconds to the first (only) token of ``prompt``, ``repeats`` times, and their median."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        server.completion_tokens(prompt, 1, xargs)
        times.append(round(time.perf_counter() - start, 3))
    return {"times_s": times, "median_s": sorted(times)[len(times) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2, help="requests dense vLLM's KV cache holds at once")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--long", type=int, default=7000)
    parser.add_argument("--long-budget", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="prefill timings per side (the median is compared)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vllm_eviction/vllm_eviction.json")
    args = parser.parse_args()
    try:  # a bad --out fails now, not after the servers ran
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a"):
            pass
    except OSError as exc:
        raise SystemExit(f"--out {args.out}: cannot write there ({exc})") from None
    if not VLLM.is_file():
        raise SystemExit(f"{VLLM} is missing: run `bash scripts/setup-vllm.sh` first")
    from transformers import AutoTokenizer

    from sparseety.models.registry import resolve_model_dir

    model = resolve_model_dir("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = token_prompts(tokenizer, args.requests, args.prompt)
    long_prompt = token_prompts(tokenizer, 1, args.long)[0]
    blocks = args.n * -(-(args.prompt + args.new) // BLOCK)
    if blocks * BLOCK < args.long + args.decode + 1:
        raise SystemExit(f"{blocks} blocks cannot hold the --long prompt: raise --n or lower --long")
    flags = serve_flags(block_size=BLOCK, num_blocks=blocks, prefix_caching=False,
                        max_model_len=max(args.prompt + args.new, args.long + args.decode + 1),
                        max_num_seqs=max(16, args.requests), max_batched_tokens=2048)
    work = Path(tempfile.mkdtemp(prefix="vllm-eviction-bench-"))
    sides = {"dense": {}, "streaming": {"SPARSEETY_KV_POLICY": "streaming", "SPARSEETY_KV_BUDGET": str(args.budget)}}
    figures: dict[str, dict] = {}
    for name, env in sides.items():
        server = VllmServer(model, None, work / f"{name}.log", flags=flags, extra_env=env, name=name)
        try:
            server.start()
            server.completion_tokens(prompts[0][:64], 2)  # warm up
            figures[name] = {"load": load(server, prompts, args.new)}
            print(name, "load", figures[name]["load"], flush=True)
            xargs = {"sparseety_budget": args.long_budget} if name == "streaming" else None  # asked per request
            figures[name]["decode"] = decode_rate(server, long_prompt, args.decode, xargs)
            print(name, "decode", figures[name]["decode"], flush=True)
            kvzap = {"sparseety_policy": "kvzap", "sparseety_budget": args.long_budget} if name == "streaming" else None
            figures[name]["prefill"] = prefill_time(server, long_prompt, args.repeats, kvzap)
            print(name, "prefill" + (" (kvzap)" if kvzap else ""), figures[name]["prefill"], flush=True)
        finally:
            server.stop()
    dense, evicting = figures["dense"], figures["streaming"]
    targets = {
        "running_vs_n": (evicting["load"]["running_peak"] / args.n, ">=", 4.0),
        "dense_running_vs_n": (dense["load"]["running_peak"] / args.n, "<=", 1.0),
        "throughput_vs_dense": (evicting["load"]["output_tokens_per_s"] / dense["load"]["output_tokens_per_s"], ">=", 1.5),
        "long_decode_vs_dense": (evicting["decode"]["decode_tokens_per_s"] / dense["decode"]["decode_tokens_per_s"],
                                 ">=", 1.3),
        "kvzap_prefill_vs_dense": (evicting["prefill"]["median_s"] / dense["prefill"]["median_s"], "<=", 1.10),
    }
    checks = {k: {"value": round(v, 3), "target": f"{op} {t}", "pass": v >= t if op == ">=" else v <= t}
              for k, (v, op, t) in targets.items()}
    for key, check in checks.items():
        print(f"{'PASS' if check['pass'] else 'MISS'}  {key:24s} {check['value']:7.3f}  (target {check['target']})")
    result = {"benchmark": "vllm_eviction", "command": command(), "kv_blocks": blocks, "block_size": BLOCK,
              "settings": vars(args) | {"out": str(args.out)}, "figures": figures, "targets": checks,
              "source": source(), "machine": machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
