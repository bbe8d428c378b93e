"""SparSEEty's continuous batching side by side with vLLM (CPU): the same prompts, greedy, same token ids.

Issue 12, "Speed and memory", "Side by side with vLLM". Prompts are windows of
``/usr/share/common-licenses/GPL-3`` at different offsets, built exactly as ``batch_bench.py`` builds them
(plain, no chat template), and both engines get the same prompt *token ids* (vLLM gets
``{"prompt_token_ids": ...}``, never text). Greedy, ``--new-tokens`` new tokens each (EOS stops both).

- ``short``: 8 prompts of ~250 tokens: SparSEEty ``dense`` against vLLM (dense; it has no eviction).
- ``long``: 8 prompts of ~4,000 tokens: SparSEEty ``dense`` and ``streaming`` budget 512 against vLLM.
  Goal: SparSEEty ``streaming``-512 tokens/s >= 1.0x vLLM's.

How it runs. vLLM lives in its own venv (``scripts/setup-vllm.sh``, ``.venv-vllm``): this script starts
itself there as a subprocess (``--vllm-worker``; the ``__main__`` guard matters, vLLM spawns its engine
process) that builds one ``vllm.LLM`` (``enforce_eager=True``, float32, prefix caching off so a repeated
prompt is recomputed, ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV) on the project's converted default model
directory and then serves ``generate`` calls over a local socket. vLLM stays up while SparSEEty runs in
this process, so runs interleave (ABBA-style, order reversed every round); vLLM's readers go idle after
1 s without work, and the CPU its processes burn while SparSEEty runs is recorded (``idle_cpu_s``).

What is timed: the wall clock of the generate call only (``LLM.generate`` in the worker;
``SparseEngine.generate_batch`` here), after one untimed warm-up on each side, so model load and engine
start-up are excluded (they are recorded beside). tokens/s = generated tokens / that wall time, prefill
included (what a caller of an offline batch sees). Beside it, from per-request first/last token times
(vLLM's engine-core timestamps; here the end of the step that produced the token): the time until the
last request's first token (``prefill_phase_s``) and each request's mean inter-token time (median over
requests, ``itl_median_s``). CPU seconds beside the wall: this process for SparSEEty, the whole vLLM
process tree (front end, engine core, worker) for vLLM.

Threads: vLLM's CPU build pins its worker's OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND=auto``
reserves one core for the engine-core process, so on this 2-core machine the worker gets one core);
SparSEEty's torch threads are set to the same count (``--threads`` overrides). Both are recorded, with
each vLLM process's affinity and thread count. The machine is shared and noisy: the load average is
recorded before and after every run, and ratios are given both from medians over rounds and as the
median of per-round ratios (runs of one round are adjacent in time).

Usage::

    .venv/bin/python -m benchmarks.vllm_compare            # 8 x 250 and 8 x 4000 tokens, 64 new; ~30 min
    .venv/bin/python -m benchmarks.vllm_compare --quick    # smoke: 4 x 250 and 4 x 1000 tokens, 16 new
"""

from __future__ import annotations

# Only the standard library and the (standard-library) launcher at the top: this file runs in the vLLM venv as
# the worker, as a script, where ``benchmarks.common`` is not importable (the driver imports it in ``main``).
import argparse
import datetime as dt
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

from sparseety.integrations.vllm_launcher import VENV, log_tail, stop_group, vllm_env

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "vllm_compare" / "vllm_compare.json"
TEXT = Path("/usr/share/common-licenses/GPL-3")
MODEL = "smollm2-135m"
TARGET_SPARSE_VS_VLLM = 1.0


# ------------------------------------------------------------------------------------------------
# vLLM worker (runs in .venv-vllm)
# ------------------------------------------------------------------------------------------------
def _tree_cpu(proc: Any) -> float:
    """User + system CPU seconds of ``proc`` and all its descendants (those alive now)."""
    import psutil

    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _worker_cpu(proc: Any) -> float:
    """CPU seconds of the model-running worker process(es) alone (``VLLM::Worker``)."""
    import psutil

    total = 0.0
    for p in proc.children(recursive=True):
        try:
            if "Worker" in p.name():
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _tree_info(proc: Any) -> list[dict[str, Any]]:
    import psutil

    out = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            out.append({"pid": p.pid, "name": p.name(), "cmdline": " ".join(p.cmdline())[:120],
                        "cpu_affinity": p.cpu_affinity(), "num_threads": p.num_threads()})
        except psutil.Error:
            pass
    return out


def vllm_worker(address: str, authkey_hex: str) -> None:
    # vllm-cpu installs as the distribution "vllm-cpu"; answer lookups of "vllm" as scripts/setup-vllm.sh's shim does.
    import importlib.metadata as metadata

    _version = metadata.version
    metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
    conn = Client(address, authkey=bytes.fromhex(authkey_hex))
    cfg = conn.recv()
    import psutil
    import vllm
    from vllm import LLM, SamplingParams

    me = psutil.Process()
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"], seed=0, disable_log_stats=False)
    startup = time.perf_counter() - t0
    warm = [{"prompt_token_ids": ids} for ids in cfg["warmup"]]
    t0 = time.perf_counter()
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    warmup = time.perf_counter() - t0
    conn.send({"vllm_version": vllm.__version__, "startup_s": startup, "warmup_s": warmup,
               "processes": _tree_info(me)})
    last_cpu = _tree_cpu(me)
    while True:
        msg = conn.recv()
        if msg["op"] == "stop":
            conn.send({"ok": True})
            break
        idle_cpu = _tree_cpu(me) - last_cpu
        prompts = [{"prompt_token_ids": ids} for ids in msg["prompts"]]
        params = SamplingParams(temperature=0.0, max_tokens=msg["max_tokens"], logprobs=msg.get("logprobs"))
        load0 = os.getloadavg()
        c0, k0 = _tree_cpu(me), _worker_cpu(me)
        w0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - w0
        cpu, worker_cpu = _tree_cpu(me) - c0, _worker_cpu(me) - k0
        last_cpu = _tree_cpu(me)
        tokens, firsts, lasts, itls, logprobs = [], [], [], [], []
        for o in outs:
            c = o.outputs[0]
            tokens.append(list(c.token_ids))
            m = o.metrics
            if m is not None and getattr(m, "first_token_ts", 0):
                firsts.append(m.first_token_ts)
                lasts.append(m.last_token_ts)
                if len(c.token_ids) > 1:
                    itls.append((m.last_token_ts - m.first_token_ts) / (len(c.token_ids) - 1))
            if msg.get("logprobs"):
                logprobs.append([sorted(v.logprob for v in step.values())[::-1][:2] for step in c.logprobs])
        ttfts = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
        conn.send({"wall_s": wall, "cpu_s": cpu, "worker_cpu_s": worker_cpu, "idle_cpu_s_before": idle_cpu, "load_before": load0,
                   "load_after": os.getloadavg(), "outputs": tokens,
                   "prefill_phase_s": max(ttfts) if ttfts else None,
                   "itl_median_s": statistics.median(itls) if itls else None,
                   "top2_logprobs": logprobs or None})
    conn.close()


# ------------------------------------------------------------------------------------------------
# driver (runs in the project venv)
# ------------------------------------------------------------------------------------------------
class VllmProcess:
    """The worker above, started in the vLLM venv, driven over a local socket."""

    def __init__(self, log_path: Path, kv_gib: int) -> None:
        self.log_path = log_path
        key = secrets.token_bytes(16)
        self.sock_dir = tempfile.mkdtemp(prefix="vllm-compare-")
        self.listener = Listener(os.path.join(self.sock_dir, "sock"), family="AF_UNIX", authkey=key)
        env = vllm_env({"TOKENIZERS_PARALLELISM": "false"}, kv_cache_gib=kv_gib)
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(k, None)
        self.env_set = {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS", "HF_HUB_OFFLINE")}
        self.env_set["VLLM_CPU_OMP_THREADS_BIND"] = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto (default)")
        self._log = open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([str(VENV / "bin" / "python"), __file__, "--vllm-worker", self.listener.address,
                                      key.hex()], env=env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.conn = self.listener.accept()

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.conn.send(msg)
        while not self.conn.poll(5):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM worker exited with {self.proc.returncode}:\n{self.log_tail()}")
        return self.conn.recv()

    def start(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return self.call(cfg)

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def binding(self) -> list[str]:
        """vLLM's own report of its OpenMP thread binding (from its log)."""
        return [line.split("[ompmultiprocessing.py", 1)[1].split("] ", 1)[-1].strip()
                for line in self.log_path.read_text(errors="replace").splitlines() if "[ompmultiprocessing.py" in line]

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call({"op": "stop"})
                self.proc.wait(60)
        except Exception:  # noqa: BLE001
            pass
        stop_group(self.proc, grace_s=30)
        self._log.close()
        self.listener.close()


def _prompts(tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    """``count`` plain prompts of exactly ``tokens`` token ids from different parts of GPL-3 (as batch_bench.py)."""
    from sparseety.engine import encode_prompt

    ids = encode_prompt(tokenizer, TEXT.read_text(), chat=False).input_ids[0]
    stride = max(1, (ids.numel() - tokens) // max(1, count))
    return [ids[i * stride: i * stride + tokens].tolist() for i in range(count)]


class StepTimes:
    """Wraps ``BatchEngine.step`` (in this process only) to note when each request's tokens come out."""

    def __init__(self) -> None:
        from sparseety.engine.batch import BatchEngine

        self.cls = BatchEngine
        self.original = BatchEngine.step
        self.tokens: dict[str, list[float]] = {}
        self.decode: list[tuple[float, float, int]] = []
        times = self

        def step(self_: Any) -> Any:
            w, c = time.perf_counter(), time.process_time()
            outputs = times.original(self_)
            now = time.perf_counter()
            for out in outputs:
                if out.token_id is not None:
                    times.tokens.setdefault(out.request.request_id, []).append(now)
            if self_.last_step.prefill_tokens == 0:  # every running sequence decoding: one token each
                times.decode.append((now - w, time.process_time() - c, len(outputs)))
            return outputs

        BatchEngine.step = step  # type: ignore[method-assign]

    def reset(self) -> None:
        self.tokens = {}
        self.decode: list[tuple[float, float, int]] = []

    def restore(self) -> None:
        self.cls.step = self.original  # type: ignore[method-assign]


def run_sparseety(engine: Any, prompts: list[list[int]], policy_name: str, budget: int | None, new_tokens: int,
                  prefill_chunk: int, times: StepTimes) -> dict[str, Any]:
    import torch

    from sparseety.engine import EncodedInput
    from sparseety.engine.request import GenerationOptions
    from sparseety.policies import build_policy

    inputs = [EncodedInput(torch.tensor([p], dtype=torch.long)) for p in prompts]
    policy = build_policy(policy_name, budget) if budget is not None else build_policy(policy_name)
    options = GenerationOptions(max_new_tokens=new_tokens, tier=0)
    times.reset()
    load0 = os.getloadavg()
    c0, w0 = time.process_time(), time.perf_counter()
    results = engine.generate_batch(inputs, policy, options, request_ids=[str(i) for i in range(len(inputs))],
                                    max_batch=len(inputs), prefill_chunk=prefill_chunk)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    firsts = [t[0] for t in times.tokens.values()]
    itls = [(t[-1] - t[0]) / (len(t) - 1) for t in times.tokens.values() if len(t) > 1]
    return {"wall_s": wall, "cpu_s": cpu, "load_before": load0, "load_after": os.getloadavg(),
            "outputs": [r.output_ids for r in results],
            "prefill_phase_s": max(firsts) - w0 if firsts else None,
            "itl_median_s": statistics.median(itls) if itls else None,
            "decode_only_tokens_per_s": sum(d[2] for d in times.decode) / sum(d[0] for d in times.decode)
            if times.decode else None,
            "decode_only_tokens_per_s_cpu": sum(d[2] for d in times.decode) / sum(d[1] for d in times.decode)
            if times.decode else None,
            "kv_peak_bytes": sum(r.kv_cache_bytes_peak for r in results),
            "kv_dense_bytes": sum(r.kv_cache_bytes_dense for r in results)}


def _finish(run: dict[str, Any]) -> dict[str, Any]:
    run["generated"] = sum(len(o) for o in run["outputs"])
    run["tokens_per_s"] = run["generated"] / run["wall_s"]
    run["tokens_per_s_cpu"] = run["generated"] / run["cpu_s"] if run["cpu_s"] else None
    if "worker_cpu_s" in run:
        run["tokens_per_s_worker_cpu"] = run["generated"] / run["worker_cpu_s"] if run["worker_cpu_s"] else None
    return run


def _compare(a: list[list[int]], b: list[list[int]]) -> list[dict[str, Any]]:
    out = []
    for x, y in zip(a, b):
        first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if first is None and len(x) != len(y):
            first = min(len(x), len(y))
        out.append({"equal": x == y, "first_difference": first, "lengths": [len(x), len(y)]})
    return out


def section(name: str, engine: Any, vllm: VllmProcess, prompts: list[list[int]], configs: list[tuple[str, str, int | None]],
            new_tokens: int, prefill_chunk: int, rounds: int, times: StepTimes) -> dict[str, Any]:
    """Run every config ``rounds`` times, interleaved (order reversed every other round)."""
    runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for label, engine_name, budget in order:
            if engine_name == "vllm":
                run = vllm.call({"op": "generate", "prompts": prompts, "max_tokens": new_tokens})
            else:
                run = run_sparseety(engine, prompts, engine_name, budget, new_tokens, prefill_chunk, times)
            _finish(run)
            runs[label].append(run)
            extra = (f", worker cpu {run['worker_cpu_s']:.1f} s, vLLM idle CPU before {run['idle_cpu_s_before']:.1f} s"
                     if "idle_cpu_s_before" in run else "")
            print(f"  {name} round {r + 1} {label:22s} {run['tokens_per_s']:7.2f} tok/s (wall {run['wall_s']:.1f} s, "
                  f"cpu {run['cpu_s']:.1f} s, load {run['load_before'][0]:.1f}{extra})", flush=True)
    summary: dict[str, Any] = {}
    keys = ("tokens_per_s", "tokens_per_s_cpu", "tokens_per_s_worker_cpu", "prefill_phase_s", "itl_median_s",
            "decode_only_tokens_per_s", "decode_only_tokens_per_s_cpu")
    for label, rs in runs.items():
        summary[label] = {}
        for key in keys:
            values = [x[key] for x in rs if x.get(key) is not None]
            if values:
                summary[label][key if key.endswith("_median_s") else key + "_median"] = statistics.median(values)
    ratios = {}
    for label in runs:
        if label == "vllm_dense":
            continue
        per_round = [s["tokens_per_s"] / v["tokens_per_s"] for s, v in zip(runs[label], runs["vllm_dense"])]
        per_round_cpu = [s["tokens_per_s_cpu"] / v["tokens_per_s_cpu"] for s, v in zip(runs[label], runs["vllm_dense"])]
        ratios[f"{label} / vllm_dense"] = {
            "of_medians": summary[label]["tokens_per_s_median"] / summary["vllm_dense"]["tokens_per_s_median"],
            "median_per_round": statistics.median(per_round), "per_round": per_round,
            "cpu_median_per_round": statistics.median(per_round_cpu),
            "cpu_vs_vllm_worker_cpu_median_per_round": statistics.median(
                s["tokens_per_s_cpu"] / v["tokens_per_s_worker_cpu"] for s, v in zip(runs[label], runs["vllm_dense"]))}
    # tokens: vLLM against SparSEEty dense, per prompt (first round of each), and the runs' own repeatability
    match = _compare(runs["vllm_dense"][0]["outputs"], runs["sparseety_dense"][0]["outputs"])
    repeat = {label: all(x["outputs"] == rs[0]["outputs"] for x in rs) for label, rs in runs.items()}
    sparse_vs_dense = None
    if "sparseety_streaming" in runs:
        sparse_vs_dense = _compare(runs["sparseety_streaming"][0]["outputs"], runs["sparseety_dense"][0]["outputs"])
    out = {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": new_tokens, "rounds": rounds,
           "summary": summary, "ratios": ratios,
           "vllm_equals_sparseety_dense": {"all": all(m["equal"] for m in match),
                                           "prompts_equal": sum(m["equal"] for m in match), "per_prompt": match},
           "outputs_repeat_across_rounds": repeat,
           "streaming_equals_dense": None if sparse_vs_dense is None else
           {"prompts_equal": sum(m["equal"] for m in sparse_vs_dense), "per_prompt": sparse_vs_dense},
           "runs": {k: [{kk: vv for kk, vv in x.items() if kk != "outputs"} for x in v] for k, v in runs.items()},
           "_outputs": {"vllm_dense": runs["vllm_dense"][0]["outputs"],
                        "sparseety_dense": runs["sparseety_dense"][0]["outputs"]}}
    return out


def margins(vllm: VllmProcess, prompts: list[list[int]], sec: dict[str, Any], new_tokens: int) -> list[dict[str, Any]]:
    """For each prompt whose tokens differ: vLLM's top-2 logprob margin at the first differing step (untimed)."""
    bad = [i for i, m in enumerate(sec["vllm_equals_sparseety_dense"]["per_prompt"]) if not m["equal"]]
    if not bad:
        return []
    got = vllm.call({"op": "generate", "prompts": [prompts[i] for i in bad], "max_tokens": new_tokens, "logprobs": 2})
    out = []
    for j, i in enumerate(bad):
        k = sec["vllm_equals_sparseety_dense"]["per_prompt"][i]["first_difference"]
        lp = (got["top2_logprobs"] or [[]])[j]
        entry = {"prompt": i, "step": k, "vllm_token": sec["_outputs"]["vllm_dense"][i][k:k + 1],
                 "sparseety_token": sec["_outputs"]["sparseety_dense"][i][k:k + 1]}
        if k is not None and k < len(lp) and len(lp[k]) == 2:
            entry["vllm_top2_logprob_margin"] = lp[k][0] - lp[k][1]
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 x 250 and 4 x 1000 tokens, 16 new tokens, budget 128")
    parser.add_argument("--threads", type=int, default=None, help="SparSEEty's torch threads (default: vLLM's worker's)")
    parser.add_argument("--rounds-short", type=int, default=None)
    parser.add_argument("--rounds-long", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=4096,
                        help="SparSEEty's prefill_chunk and vLLM's max_num_batched_tokens (tokens per step)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--vllm-worker", nargs=2, metavar=("ADDRESS", "KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return
    if not (VENV / "bin" / "python").is_file():
        sys.exit(f"error: the vLLM side venv {VENV} is absent: build it with `bash scripts/setup-vllm.sh`")
    from benchmarks.common import command, machine, source
    count, short_tokens, long_tokens, new_tokens, budget = (4, 250, 1000, 16, 128) if args.quick \
        else (8, 250, 4000, 64, 512)
    rounds_short = args.rounds_short or (2 if args.quick else 3)
    rounds_long = args.rounds_long or (2 if args.quick else 2)

    import torch

    from sparseety.engine import SparseEngine
    from sparseety.models import load_model
    from sparseety.models.registry import resolve_model_dir

    started = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    model_dir = resolve_model_dir(MODEL)
    t0 = time.perf_counter()
    model, tokenizer = load_model(MODEL)
    engine = SparseEngine(model, tokenizer, MODEL)
    sparseety_load = time.perf_counter() - t0
    short = _prompts(tokenizer, count, short_tokens)
    long = _prompts(tokenizer, count, long_tokens)

    log_path = Path(tempfile.mkdtemp(prefix="vllm-compare-log-")) / "vllm.log"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting vLLM ({VENV}) on {model_dir}; its log: {log_path}", flush=True)
    vllm = VllmProcess(log_path, kv_gib=2)
    try:
        info = vllm.start({"model": model_dir, "max_model_len": long_tokens + new_tokens + 64,
                           "max_num_seqs": count, "max_num_batched_tokens": args.prefill_chunk,
                           "warmup": [short[0][:32], short[1][:32]]})
        binding = vllm.binding()
        worker = [p for p in info["processes"] if len(p["cpu_affinity"]) < (os.cpu_count() or 1)]
        vllm_threads = len(worker[0]["cpu_affinity"]) if worker else None
        threads = args.threads or vllm_threads or 1
        torch.set_num_threads(threads)
        print(f"vLLM {info['vllm_version']} up in {info['startup_s']:.0f} s (warm-up {info['warmup_s']:.1f} s); "
              f"binding: {' | '.join(binding)}; SparSEEty torch threads: {threads}", flush=True)
        times = StepTimes()
        t0 = time.perf_counter()
        run_sparseety(engine, [p[:32] for p in short[:2]], "dense", None, 4, args.prefill_chunk, times)
        run_sparseety(engine, [p[:32] for p in short[:2]], "streaming", 16, 4, args.prefill_chunk, times)
        sparseety_warmup = time.perf_counter() - t0

        print(f"short: {count} x {short_tokens} tokens, {new_tokens} new", flush=True)
        sec_short = section("short", engine, vllm, short, [("vllm_dense", "vllm", None), ("sparseety_dense", "dense", None)],
                            new_tokens, args.prefill_chunk, rounds_short, times)
        print(f"long: {count} x {long_tokens} tokens, {new_tokens} new, streaming budget {budget}", flush=True)
        sec_long = section("long", engine, vllm, long, [("vllm_dense", "vllm", None), ("sparseety_dense", "dense", None),
                                                        ("sparseety_streaming", "streaming", budget)],
                           new_tokens, args.prefill_chunk, rounds_long, times)
        for sec, prompts in ((sec_short, short), (sec_long, long)):
            sec["token_mismatch_margins"] = margins(vllm, prompts, sec, new_tokens)
            sec.pop("_outputs")
        times.restore()
    finally:
        vllm.stop()

    goal = sec_long["ratios"]["sparseety_streaming / vllm_dense"]
    def ratio(sec: dict[str, Any], label: str) -> dict[str, float]:
        r = sec["ratios"][f"{label} / vllm_dense"]
        return {"wall": round(r["median_per_round"], 3), "cpu": round(r["cpu_median_per_round"], 3),
                "cpu_vs_vllm_worker_cpu": round(r["cpu_vs_vllm_worker_cpu_median_per_round"], 3)}

    headline = {
        f"short {count}x{short_tokens}: SparSEEty dense / vLLM dense tokens/s": ratio(sec_short, "sparseety_dense"),
        f"long {count}x{long_tokens}: SparSEEty dense / vLLM dense tokens/s": ratio(sec_long, "sparseety_dense"),
        f"long {count}x{long_tokens}: SparSEEty streaming-{budget} / vLLM dense tokens/s (goal >= 1.0, wall)":
            {**ratio(sec_long, "sparseety_streaming"), "target": f">= {TARGET_SPARSE_VS_VLLM}",
             "met": goal["median_per_round"] >= TARGET_SPARSE_VS_VLLM},
        "tokens/s (median over rounds)": {
            sec: {k: round(v["tokens_per_s_median"], 2) for k, v in s["summary"].items()}
            for sec, s in (("short", sec_short), ("long", sec_long))},
        "tokens per CPU-second (median over rounds; vLLM: its whole process tree)": {
            sec: {k: round(v["tokens_per_s_cpu_median"], 2) for k, v in s["summary"].items()}
            for sec, s in (("short", sec_short), ("long", sec_long))},
        "threads": f"SparSEEty torch {threads}, vLLM worker cores {vllm_threads}",
        "vLLM greedy tokens == SparSEEty dense, prompts": {
            "short": f"{sec_short['vllm_equals_sparseety_dense']['prompts_equal']}/{count}",
            "long": f"{sec_long['vllm_equals_sparseety_dense']['prompts_equal']}/{count}"},
    }
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "quick": args.quick,
           "command": command(), "source": source(), "machine": machine(load_average_at_start=load_at_start),
           "model": MODEL, "model_dir": model_dir, "dtype": "float32", "greedy": True,
           "clock": "wall of the generate call only (tokens/s = generated / wall, prefill included); CPU beside",
           "threads": {"sparseety_torch_threads": threads, "vllm_worker_cores": vllm_threads,
                       "vllm_binding_log": binding, "vllm_processes": info["processes"]},
           "vllm": {"version": info["vllm_version"], "venv": str(VENV.relative_to(ROOT)) if VENV.is_relative_to(ROOT)
                    else str(VENV), "env": vllm.env_set,
                    "llm_args": {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False,
                                 "max_num_seqs": count, "max_num_batched_tokens": args.prefill_chunk,
                                 "max_model_len": long_tokens + new_tokens + 64},
                    "startup_s": info["startup_s"], "warmup_s": info["warmup_s"]},
           "sparseety": {"api": "SparseEngine.generate_batch(inputs, policy, GenerationOptions(max_new_tokens, tier=0), "
                                "max_batch=N, prefill_chunk=P)", "prefill_chunk": args.prefill_chunk,
                         "load_s": sparseety_load, "warmup_s": sparseety_warmup},
           "headline": headline, "short": sec_short, "long": sec_long,
           "total_s": time.perf_counter() - started}
    print(json.dumps(headline, indent=1))
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
