"""SparSEEty's KV policies side by side with NVIDIA's kvpress presses on the same passkey cases.

Usage (from the repository root)::

    .venv/bin/python benchmarks/kvpress_compare.py [--lengths 1000,1500] [--depths 0.1,0.5,0.9]
                                                   [--ratios 0.25,0.5,0.75] [--max-new-tokens 14]

kvpress needs ``transformers<5.3``, so it never enters SparSEEty's environment: this script creates
``benchmarks/.kvpress-venv`` (``python -m venv``; torch 2.13.0 CPU from the local wheel, then
``kvpress`` and ``transformers<5.3``) and runs the kvpress side there as a worker subprocess
(``--worker CASES OUT``, which imports only torch, transformers and kvpress).

Both tools get the same model (the safetensors folder SparSEEty converted the default model into),
the same token ids (context and question encoded once by ``sparseety.engine.encode_document``, cases from
``sparseety.bench.passkey``) and the same protocol: the context prefilled under the press/policy, the
question fed uncompressed at its true positions, then a greedy answer. Pairs:
streaming/StreamingLLMPress, snapkv/SnapKVPress, knorm/KnormPress, tova/TOVAPress and
h2o/ObservedAttentionPress, each with its library's default options. Per policy and ratio it prints
accuracy, seconds per case and the KV bytes held at the end (keys and values of every layer), and
saves ``benchmarks/results/kvpress_compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".kvpress-venv"
RESULTS = ROOT / "results" / "kvpress_compare.json"
PAIRS = {"streaming": "StreamingLLMPress", "snapkv": "SnapKVPress", "knorm": "KnormPress", "tova": "TOVAPress",
         "h2o": "ObservedAttentionPress"}


# -- kvpress side (runs inside benchmarks/.kvpress-venv) ---------------------------------------------------

def worker(cases_path: str, out_path: str) -> None:
    """Answer every case under each press at each ratio (and with no press), greedy, kvpress's protocol."""
    import torch
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    spec = json.loads(Path(cases_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    impls = {"eager" if theirs == "ObservedAttentionPress" else "sdpa" for _, theirs, _ in spec["plan"]}
    models = {impl: AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32,
                                                         attn_implementation=impl).eval()
              for impl in impls}
    eos = next(iter(models.values())).generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])

    def answer(model, press, context_ids, question_ids):
        cache = DynamicCache()
        context = torch.tensor([context_ids])
        question = torch.tensor([question_ids])
        start = time.perf_counter()
        with torch.inference_mode():
            with press(model) if press is not None else _nullcontext():
                model.model(input_ids=context, past_key_values=cache)
            # kvpress's pipeline.generate_answer: the question at its true positions, then greedy tokens.
            position_ids = torch.arange(len(context_ids), len(context_ids) + len(question_ids)).unsqueeze(0)
            out = model(input_ids=question, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
            position_ids = position_ids[:, -1:] + 1
            generated = [out.logits[0, -1].argmax()]
            for i in range(spec["max_new_tokens"] - 1):
                if generated[-1].item() in stop:
                    break
                out = model(input_ids=generated[-1].view(1, 1), past_key_values=cache, position_ids=position_ids + i)
                generated.append(out.logits[0, -1].argmax())
        seconds = time.perf_counter() - start
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        text = tokenizer.decode(torch.stack(generated), skip_special_tokens=True)
        return text, seconds, held

    rows = []
    for ours, theirs, ratio in spec["plan"]:
        press = None if theirs is None else getattr(kvpress, theirs)(compression_ratio=ratio)
        model = models["eager" if theirs == "ObservedAttentionPress" else "sdpa"]
        for case in spec["cases"]:
            text, seconds, held = answer(model, press, case["context_ids"], case["question_ids"])
            rows.append({"policy": ours, "press": theirs, "ratio": ratio, "length": case["length"],
                         "depth": case["depth"], "answer": text, "correct": _correct(case["passkey"], text),
                         "seconds": seconds, "kv_bytes": held})
            print(f"kvpress {theirs or 'none'} ratio={ratio} depth={case['depth']} length={case['length']}: "
                  f"{'ok' if rows[-1]['correct'] else 'miss'} {text.strip()[:40]!r}", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps({"kvpress_version": _version("kvpress"),
                                          "transformers_version": _version("transformers"), "rows": rows}))


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _correct(passkey: str, answer: str) -> bool:
    """Same rule as ``sparseety.bench.passkey.is_correct`` (this side cannot import SparSEEty)."""
    import re

    return passkey in re.sub(r"(?<=\d)[,\s](?=\d)", "", answer)


# -- SparSEEty side and the table (runs in SparSEEty's .venv) ---------------------------------------------

def ensure_venv() -> Path:
    """Create ``benchmarks/.kvpress-venv`` with torch 2.13.0 (CPU), kvpress and transformers<5.3 once."""
    python = VENV / "bin" / "python"
    probe = [str(python), "-c", "import kvpress, transformers, torch; assert transformers.__version__ < '5.3'"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {VENV} (torch 2.13.0 CPU, kvpress, transformers<5.3) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # pinned: the CPU wheel on local disk
    subprocess.run([*pip, "kvpress", "transformers<5.3", "torch==2.13.0"], check=True)
    subprocess.run(probe, check=True)
    return python


def sparseety_side(engine, cases, encoded, name, ratio, max_new_tokens):
    """The cases through SparSEEty's engine (long-document protocol) with policy ``name`` at ``ratio``."""
    from sparseety.bench.passkey import is_correct
    from sparseety.policies import build_policy, resolve_budget

    rows = []
    for case, enc in zip(cases, encoded):
        budget = None if name == "dense" else resolve_budget(None, ratio, enc.compress_len)
        start = time.perf_counter()
        result = engine.generate(enc, build_policy(name, budget), max_new_tokens=max_new_tokens, tier=0)
        seconds = time.perf_counter() - start
        rows.append({"policy": name, "ratio": ratio, "length": case.length, "depth": case.depth,
                     "answer": result.text, "correct": is_correct(case.passkey, result.text),
                     "seconds": seconds, "kv_bytes": result.kv_cache_bytes_peak})
        print(f"sparseety {name} ratio={ratio} depth={case.depth} length={case.length}: "
              f"{'ok' if rows[-1]['correct'] else 'miss'} {result.text.strip()[:40]!r}", file=sys.stderr, flush=True)
    return rows


def summarize(rows):
    """``{(policy, ratio): (accuracy, mean seconds, mean kv bytes)}``."""
    groups = {}
    for r in rows:
        groups.setdefault((r["policy"], r["ratio"]), []).append(r)
    return {k: (sum(r["correct"] for r in v) / len(v), sum(r["seconds"] for r in v) / len(v),
                sum(r["kv_bytes"] for r in v) / len(v)) for k, v in groups.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default="1000,1500")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--max-new-tokens", type=int, default=14)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return

    from sparseety.bench.passkey import QUESTION, make_cases, tokenizer_counter
    from sparseety.engine import SparseEngine, encode_document
    from sparseety.models import DEFAULT_MODEL, load_model
    from sparseety.models.registry import resolve_model_dir

    kv_python = ensure_venv()
    ratios = [float(x) for x in args.ratios.split(",")]
    model, tokenizer = load_model(DEFAULT_MODEL)
    cases = make_cases([int(x) for x in args.lengths.split(",")], [float(x) for x in args.depths.split(",")],
                       args.seed, tokenizer_counter(tokenizer))
    encoded = [encode_document(tokenizer, c.context, QUESTION, None) for c in cases]
    spec = {"model_dir": resolve_model_dir(DEFAULT_MODEL), "max_new_tokens": args.max_new_tokens, "ratios": ratios,
            "pairs": PAIRS,
            "cases": [{"length": c.length, "depth": c.depth, "passkey": c.passkey,
                       "context_ids": e.input_ids[0, : e.compress_len].tolist(),
                       "question_ids": e.input_ids[0, e.compress_len:].tolist()} for c, e in zip(cases, encoded)]}

    # Interleaved: each (policy, ratio) runs on SparSEEty, then on kvpress, so load on this shared
    # machine falls on both tools alike.
    engine = SparseEngine(model, tokenizer, DEFAULT_MODEL)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ours, kv_rows, kv = [], [], {}
    ours_s = theirs_s = 0.0
    plan = [("dense", None, 0.0)] + [(p, PAIRS[p], r) for p in PAIRS for r in ratios]
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        for entry in plan:
            start = time.perf_counter()
            ours += sparseety_side(engine, cases, encoded, entry[0], entry[2], args.max_new_tokens)
            ours_s += time.perf_counter() - start
            cases_path.write_text(json.dumps({**spec, "plan": [entry]}))
            start = time.perf_counter()
            subprocess.run([str(kv_python), __file__, "--worker", str(cases_path), str(out_path)], check=True, env=env)
            theirs_s += time.perf_counter() - start
            kv = json.loads(out_path.read_text())
            kv_rows += kv["rows"]
    kv["rows"] = kv_rows

    a, b = summarize(ours), summarize(kv["rows"])
    dense_a, dense_b = a[("dense", 0.0)][2], b[("dense", 0.0)][2]
    header = (f"{'policy':<10} {'ratio':>5} | {'acc sparseety':>13} {'acc kvpress':>11} | "
              f"{'s/case ours':>11} {'s/case kvp':>10} | {'KV MiB ours':>11} {'KV MiB kvp':>10} | "
              f"{'KV/dense ours':>13} {'KV/dense kvp':>12}")
    print(header)
    print("-" * len(header))
    table = []
    for key in a:
        (acc_a, sec_a, kv_a), (acc_b, sec_b, kv_b) = a[key], b[key]
        table.append({"policy": key[0], "press": PAIRS.get(key[0]), "ratio": key[1],
                      "accuracy_sparseety": acc_a, "accuracy_kvpress": acc_b,
                      "seconds_per_case_sparseety": round(sec_a, 3), "seconds_per_case_kvpress": round(sec_b, 3),
                      "kv_bytes_sparseety": int(kv_a), "kv_bytes_kvpress": int(kv_b),
                      "kv_fraction_of_dense_sparseety": round(kv_a / dense_a, 4),
                      "kv_fraction_of_dense_kvpress": round(kv_b / dense_b, 4)})
        print(f"{key[0]:<10} {key[1]:>5} | {acc_a:>13.0%} {acc_b:>11.0%} | {sec_a:>11.2f} {sec_b:>10.2f} | "
              f"{kv_a / 2**20:>11.2f} {kv_b / 2**20:>10.2f} | {kv_a / dense_a:>13.3f} {kv_b / dense_b:>12.3f}")
    at_half = {r["policy"]: r["accuracy_sparseety"] >= r["accuracy_kvpress"] for r in table if r["ratio"] == 0.5}
    print(f"target: SparSEEty accuracy >= kvpress at ratio 0.5 for every pair: "
          f"{'met' if all(at_half.values()) else 'missed by ' + ', '.join(k for k, v in at_half.items() if not v)}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": "python benchmarks/kvpress_compare.py " + " ".join(sys.argv[1:]),
        "model": DEFAULT_MODEL, "kvpress_version": kv["kvpress_version"],
        "kvpress_transformers_version": kv["transformers_version"], "max_new_tokens": args.max_new_tokens,
        "cases": [{"length": c.length, "depth": c.depth, "passkey": c.passkey, "context_tokens": e.compress_len}
                  for c, e in zip(cases, encoded)],
        "wall_seconds": {"sparseety": round(ours_s, 1), "kvpress_including_worker_start": round(theirs_s, 1)},
        "target_at_ratio_0.5": at_half, "table": table, "rows": {"sparseety": ours, "kvpress": kv["rows"]},
    }, indent=1))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
