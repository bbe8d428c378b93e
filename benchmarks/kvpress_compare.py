"""SparSEEty's KV policies side by side with NVIDIA's kvpress presses on the same cases and token ids.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.kvpress_compare [--tasks passkey,niah_single,niah_multikey,niah_multivalue,vt,cwe]
        [--lengths 1000,1500] [--depths 0.1,0.5,0.9] [--seeds 0]            # the passkey cases
        [--ruler-lengths 1000,2000] [--ruler-cases 1] [--ruler-seed 0]      # the RULER-style cases
        [--ratios 0.25,0.5,0.75] [--policies all] [--max-new-tokens 14] [--threads 1]
        [--out benchmarks/results/kvpress_compare/kvpress_compare.json] [--resume]

kvpress needs ``transformers<5.3``, so it never enters SparSEEty's environment: this script creates
``benchmarks/.kvpress-venv`` (``python -m venv``; torch 2.13.0 CPU from the local wheel, then ``kvpress``
(0.5.5, the newest release, checked with ``pip index versions kvpress``) and ``transformers<5.3``) and
runs the kvpress side there as one long-lived worker subprocess (``--worker MODEL_DIR``, which imports
only torch, transformers and kvpress and answers one JSON job per stdin line).

Both tools get the same model (the safetensors folder SparSEEty converted the default model into), the
same token ids (each case encoded once, here: passkey cases by ``sparseety.engine.encode_document``, RULER
cases by ``sparseety.suites.ruler.encode_case`` with RULER's answer prefix), the same protocol (the context
prefilled under the press/policy, the question fed uncompressed at its true positions, then a greedy
answer) and the same scoring, done here on both sides' answers (passkey: the digits appear; RULER: the
fraction of the expected items found). Pairs, each with its library's default options:

    streaming/StreamingLLMPress, snapkv/SnapKVPress, knorm/KnormPress, tova/TOVAPress,
    h2o/ObservedAttentionPress, keydiff/KeyDiffPress, expected_attention/ExpectedAttentionPress,
    compactor/CompactorPress, kvzip/KVzipPress, kvzap/KVzapPress

``kvzap`` beside ``KVzapPress`` with the linear surrogate ``benchmarks/kvpress_kvzap_train.py`` trained with
kvpress's own ``kvzap/train.py`` code on SparSEEty's training texts; ``kvzap_dms`` (``kvzap threshold=T``) beside
``DMSPress(KVzapPress, threshold=T)``, each side's ``T`` the quantile of its predicted scores at the run's
ratio (that script's ``summary.json``); ``kvzap_share`` (``share=true per_head=false``) and ``kvzap_floor25``/``50``/``75``
(the same with ``floor=0.25``...) on SparSEEty's side only; ``kvzap_eq`` is threshold mode at the threshold that holds
the same memory as the ratio on the training texts (``layer_thresholds``), beside ``DMSPress(KVzapPress)``;
``kvzap_per_head`` (``per_head=true``: a layer's heads share its budget, ``kvzap``'s default since 2026-12-03;
the ``kvzap`` rows of files written before then are ``per_head=false``, now ``kvzap_uniform``) on SparSEEty's side only;
``kvzap_share_heads`` (``per_head=true share=true``: every layer's heads share the total, as kvzip's do) and
``kvzip_layerwise`` (``layerwise=true``: each layer's heads share its budget, as kvzap's do by default) on
SparSEEty's side only, to tell the allocation's part from the scores'. ``pyramid``
and ``learned`` on SparSEEty's side only (``learned`` with
``model=benchmarks/results/learned_policy/policy.safetensors``, the file ``benchmarks/learned_policy_bench.py``
trains; skipped when it is missing). kvpress's KVzipPress runs its reconstruction passes inside the press
context (one chat-template "Repeat the previous context exactly." pass per 2,048 context tokens) and then
*masks* the evicted pairs in attention instead of removing them, so the KV bytes it holds stay dense; the
table reports what each cache really holds (keys and values of every layer at the end of the answer).

Each (policy, ratio) runs on SparSEEty, then on kvpress, before the next (interleaved), so load on this
shared machine falls on both tools alike. Results are rewritten after every pair (``"complete": false``
until the end); ``--resume`` continues an unfinished file with the same settings. One torch thread per
side by default (DESIGN.md: two threads on two busy cores run several times slower).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".kvpress-venv"
RESULTS = ROOT / "results" / "kvpress_compare" / "kvpress_compare.json"
LEARNED_FILE = ROOT / "results" / "learned_policy" / "policy.safetensors"
PAIRS = {"streaming": "StreamingLLMPress", "snapkv": "SnapKVPress", "knorm": "KnormPress", "tova": "TOVAPress",
         "h2o": "ObservedAttentionPress", "keydiff": "KeyDiffPress", "expected_attention": "ExpectedAttentionPress",
         "compactor": "CompactorPress", "kvzip": "KVzipPress", "kvzap": "KVzapPress"}
OURS_ONLY = ("pyramid", "learned")
#: ``threshold=`` placeholders of the kvzap variants: which calibration of ``summary.json`` they take
CALIBRATED = {"calibrated": "thresholds", "calibrated_layers": "layer_thresholds"}
#: kvpress's KVzap surrogate, trained here by ``benchmarks/kvpress_kvzap_train.py`` (its hub weights are out of
#: reach); that script's summary also holds both sides' DMS thresholds per ratio.
KVZAP_DIR = ROOT / "results" / "kvpress_kvzap_train"
#: Named variants of a policy with other options, run and reported under their own name beside its press.
VARIANTS = {"kvzip_chunk": ("kvzip", {"attend": "chunk"}),
            "h2o_va": ("h2o", {"value_aware": True}), "tova_va": ("tova", {"value_aware": True}),
            "snapkv_va": ("snapkv", {"value_aware": True}),
            # threshold mode (DMS): the ratio picks each side's calibrated threshold (see KVZAP_DIR)
            "kvzap_dms": ("kvzap", {"threshold": "calibrated"}),
            "kvzap_share": ("kvzap", {"share": True, "per_head": False}),
            "kvzap_uniform": ("kvzap", {"per_head": False}),
            "kvzap_eq": ("kvzap", {"threshold": "calibrated_layers"}),
            "kvzap_per_head": ("kvzap", {"per_head": True}),
            # the allocation apart from the scores: kvzap's heads sharing every layer's budget, as kvzip's do;
            # kvzip's heads sharing only their own layer's, as kvzap's do by default
            "kvzap_share_heads": ("kvzap", {"per_head": True, "share": True}),
            "kvzip_layerwise": ("kvzip", {"layerwise": True}),
            **{f"kvzap_floor{int(f * 100)}": ("kvzap", {"share": True, "per_head": False, "floor": f})
               for f in (0.25, 0.5, 0.75)}}
#: Variants with a press of their own (else a variant sits beside its base policy's press): the value-aware
#: options beside kvpress's CriticalKVPress around the same press (CriticalKV, arXiv 2502.03805, weighs by
#: ‖W_O v‖₁ in two stages; VATP, which ``value_aware`` follows, by ‖v‖₁; kvpress has no VATP press).
VARIANT_PRESSES = {"h2o_va": "CriticalKVPress(ObservedAttentionPress)", "tova_va": "CriticalKVPress(TOVAPress)",
                   "snapkv_va": "CriticalKVPress(SnapKVPress)", "kvzap_dms": "DMSPress(KVzapPress)",
                   "kvzap_eq": "DMSPress(KVzapPress)"}
PAIRS.update({variant: VARIANT_PRESSES.get(variant, PAIRS[base]) for variant, (base, _) in VARIANTS.items()})
RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
#: what names one case (with the side, the policy and the ratio: one answer)
CASE_KEYS = ("task", "length", "depth", "index", "seed")
#: query-agnostic methods: they score the context without the question (all here are, under this protocol,
#: since the question is never seen while compressing); kept for the target's wording
EAGER_PRESSES = {"ObservedAttentionPress"}  # needs attention weights: eager attention on the kvpress side


# -- kvpress side (runs inside benchmarks/.kvpress-venv) ---------------------------------------------------

def worker(model_dir: str, threads: int) -> None:
    """Answer jobs from stdin, one JSON line each: ``{"press", "ratio", "cases": [{"context_ids",
    "question_ids", "max_new_tokens"}]}``; reply one JSON line per job on stdout with the answers."""
    import torch
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    models: dict[str, object] = {}

    def model_for(press_name):
        impl = "eager" if any(name in str(press_name) for name in EAGER_PRESSES) else "sdpa"
        if impl not in models:
            models[impl] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                attn_implementation=impl).eval()
        return models[impl]

    def answer(model, press, context_ids, question_ids, max_new_tokens):
        eos = model.generation_config.eos_token_id
        stop = set(eos if isinstance(eos, list) else [eos])
        cache = DynamicCache()
        context = torch.tensor([context_ids])
        question = torch.tensor([question_ids])
        torch.manual_seed(0)  # CompactorPress draws a random sketch
        start = time.perf_counter()
        with torch.inference_mode():
            with press(model) if press is not None else _nullcontext():
                model.model(input_ids=context, past_key_values=cache)
            # kvpress's pipeline.generate_answer: the question at its true positions, then greedy tokens.
            position_ids = torch.arange(len(context_ids), len(context_ids) + len(question_ids)).unsqueeze(0)
            out = model(input_ids=question, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
            position_ids = position_ids[:, -1:] + 1
            generated = [out.logits[0, -1].argmax()]
            for i in range(max_new_tokens - 1):
                if generated[-1].item() in stop:
                    break
                out = model(input_ids=generated[-1].view(1, 1), past_key_values=cache, position_ids=position_ids + i)
                generated.append(out.logits[0, -1].argmax())
        seconds = time.perf_counter() - start
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        masked = getattr(press, "compression_ratios", None)  # DMSPress: the pairs it masked, per layer
        kept = None if not masked else round(1 - sum(masked.values()) / len(masked), 4)
        for layer in getattr(model.model, "layers", []):  # KVzipPress leaves its mask on the modules
            if hasattr(layer.self_attn, "masked_key_indices"):
                layer.self_attn.masked_key_indices = None
        text = tokenizer.decode(torch.stack(generated), skip_special_tokens=True)
        return {"answer": text, "seconds": seconds, "kv_bytes": held, "kept_fraction": kept}

    print(json.dumps({"ready": True, "kvpress_version": _version("kvpress"),
                      "transformers_version": _version("transformers"), "torch_version": _version("torch")}),
          flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        name = job["press"]
        model = model_for(name)
        press = None if name is None else make_press(kvpress, name, job["ratio"], model)
        rows = []
        for case in job["cases"]:
            rows.append(answer(model, press, case["context_ids"], case["question_ids"], case["max_new_tokens"]))
            print(f"kvpress {name or 'none'} ratio={job['ratio']} {case['label']}: {rows[-1]['answer'].strip()[:40]!r}",
                  file=sys.stderr, flush=True)
        print(json.dumps({"rows": rows}), flush=True)


def make_press(kvpress, name: str, ratio: float, model):
    """``Press`` or ``Wrapper(Press)`` (a wrapper takes the inner press, which holds the ratio). ``KVzapPress``
    gets the surrogate trained here; ``DMSPress`` takes no ratio but the threshold calibrated for it."""
    if name.endswith(")") and "(" in name:
        outer, inner = name[:-1].split("(", 1)
        if outer == "DMSPress":
            return kvpress.DMSPress(make_press(kvpress, inner, 0.0, model), threshold=kvzap_threshold("kvpress", ratio))
        return getattr(kvpress, outer)(make_press(kvpress, inner, ratio, model))
    press = getattr(kvpress, name)(compression_ratio=ratio)
    if name == "KVzapPress":
        # KVzapPress loads nvidia/KVzap-<type>-<model folder> from the hub unless that name is already loaded
        from kvpress.presses.kvzap_press import KVzapModel

        press.model_type = "linear"
        press.kvzap_model_name = f"nvidia/KVzap-linear-{str(model.config.name_or_path).split('/')[-1]}"
        press.kvzap_model = KVzapModel.from_pretrained(str(KVZAP_DIR / "linear"))
    return press


def kvzap_threshold(side: str, ratio: float, kind: str = "thresholds") -> float:
    """The DMS threshold of ``side`` (``sparseety`` or ``kvpress``) that, over the held-out training texts,
    puts a fraction ``ratio`` of the (token, layer, KV head) scores below it; with ``kind="layer_thresholds"``
    (SparSEEty only) the one at which ``kvzap threshold=T``, every head keeping its layer's busiest head's
    count, holds ``1 - ratio`` of the tokens."""
    summary = KVZAP_DIR / "summary.json"
    if not summary.is_file():
        raise SystemExit(f"error: {summary} is missing: run benchmarks/kvpress_kvzap_train.py first")
    figures = json.loads(summary.read_text())[side]
    thresholds = (figures["surrogates"]["linear"] if side == "kvpress" else figures).get(kind, {})
    if str(ratio) not in thresholds:
        raise SystemExit(f"error: no {side} threshold calibrated for ratio {ratio} (have {', '.join(thresholds)})")
    return float(thresholds[str(ratio)])


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


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


class KvpressWorker:
    """The kvpress side as one subprocess: jobs go in on stdin, answers come back on stdout."""

    def __init__(self, python: Path, model_dir: str, threads: int) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen([str(python), __file__, "--worker", model_dir, "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the kvpress worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, press: str | None, ratio: float, cases: list[dict]) -> list[dict]:
        self.proc.stdin.write(json.dumps({"press": press, "ratio": ratio, "cases": cases}) + "\n")
        self.proc.stdin.flush()
        return self._read()["rows"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def build_cases(args, tokenizer) -> list[dict]:
    """Every case of the run, encoded once: ``{"task", "length", "depth" | "index", "seed", "expected",
    "context_ids", "question_ids", "max_new_tokens", "label"}``."""
    from sparseety.suites.passkey import QUESTION, make_cases, tokenizer_counter
    from sparseety.suites.ruler import encode_case, make_ruler_cases
    from sparseety.engine import encode_document

    count = tokenizer_counter(tokenizer)
    tasks = [t for t in args.tasks.split(",") if t]
    out = []
    if "passkey" in tasks:
        for seed in (int(s) for s in args.seeds.split(",")):
            for c in make_cases([int(x) for x in args.lengths.split(",")], [float(x) for x in args.depths.split(",")],
                                seed, count):
                e = encode_document(tokenizer, c.context, QUESTION, None)
                out.append({"task": "passkey", "length": c.length, "depth": c.depth, "seed": seed,
                            "expected": [c.passkey], "max_new_tokens": args.max_new_tokens,
                            "context_ids": e.input_ids[0, : e.compress_len].tolist(),
                            "question_ids": e.input_ids[0, e.compress_len:].tolist(),
                            "label": f"passkey length={c.length} depth={c.depth} seed={seed}"})
    ruler = [t for t in tasks if t != "passkey"]
    unknown = sorted(set(ruler) - set(RULER_TASKS))
    if unknown:
        raise SystemExit(f"error: --tasks: unknown task(s) {', '.join(unknown)}; valid: passkey, {', '.join(RULER_TASKS)}")
    for c in make_ruler_cases(ruler, [int(x) for x in args.ruler_lengths.split(",")], args.ruler_cases,
                              args.ruler_seed, count):
        e = encode_case(tokenizer, c, None)
        out.append({"task": c.task, "length": c.length, "index": c.index, "seed": c.seed, "depth": c.depth,
                    "expected": list(c.expected), "max_new_tokens": c.max_new_tokens,
                    "context_ids": e.input_ids[0, : e.compress_len].tolist(),
                    "question_ids": e.input_ids[0, e.compress_len:].tolist(),
                    "label": f"{c.task} length={c.length} case={c.index}"})
    return out


def score_case(case: dict, answer: str) -> float:
    """Passkey: 1.0 when the digits appear (``is_correct``); RULER: the fraction of expected items found."""
    from sparseety.suites.passkey import is_correct
    from sparseety.suites.ruler import score

    if case["task"] == "passkey":
        return float(is_correct(case["expected"][0], answer))
    return score(case["expected"], answer)


def row_of(case: dict, policy: str, ratio: float, answer: str, seconds: float, kv_bytes: int,
           kept_fraction: float | None = None) -> dict:
    """One answer's row; ``kept_fraction``: the share of KV pairs a masking press left unmasked, when it says."""
    keys = {k: case[k] for k in CASE_KEYS if k in case}
    row = {"policy": policy, "ratio": ratio, **keys, "answer": answer, "score": score_case(case, answer),
           "seconds": round(seconds, 3), "kv_bytes": int(kv_bytes)}
    return row if kept_fraction is None else row | {"kept_fraction": kept_fraction}


def sparseety_side(engine, cases, name, ratio, options, threads):
    """The cases through SparSEEty's engine (long-document protocol) with policy ``name`` at ``ratio``."""
    import torch

    from sparseety.suites.longdoc import answer_document
    from sparseety.engine import EncodedInput

    torch.set_num_threads(threads)
    rows = []
    for case in cases:
        ids = torch.tensor([case["context_ids"] + case["question_ids"]], dtype=torch.long)
        encoded = EncodedInput(ids, compress_len=len(case["context_ids"]))
        policy, variant_options = VARIANTS.get(name, (name, {}))
        chosen, budget_ratio = {**variant_options, **(options or {})}, ratio
        if chosen.get("threshold") in CALIBRATED:  # threshold mode: no budget
            chosen["threshold"], budget_ratio = kvzap_threshold("sparseety", ratio, CALIBRATED[chosen["threshold"]]), None
        got = answer_document(engine, encoded, policy, budget_ratio, options=chosen,
                              max_new_tokens=case["max_new_tokens"])
        rows.append(row_of(case, name, ratio, got.text, got.seconds, got.kv_cache_bytes_peak))
        print(f"sparseety {name} ratio={ratio} {case['label']}: {rows[-1]['score']:.0%} {got.text.strip()[:40]!r}",
              file=sys.stderr, flush=True)
    return rows


def merged_rows(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """``(sparseety rows, kvpress rows)`` of saved result files; the same case under the same policy and ratio,
    run by two files, counts once (the later file's row)."""
    docs = [json.loads(Path(path).read_text()) for path in paths]

    def unique(side: str) -> list[dict]:
        key = lambda r: tuple(r.get(k) for k in ("policy", "ratio", *CASE_KEYS))  # noqa: E731
        return list({key(r): r for d in docs for r in d["rows"][side]}.values())

    return unique("sparseety"), unique("kvpress")


def summarize(rows):
    """``{(task, policy, ratio): (mean score, mean seconds, mean kv bytes, n)}``."""
    groups = {}
    for r in rows:
        groups.setdefault((r["task"], r["policy"], r["ratio"]), []).append(r)
    return {k: (sum(r["score"] for r in v) / len(v), sum(r["seconds"] for r in v) / len(v),
                sum(r["kv_bytes"] for r in v) / len(v), len(v)) for k, v in groups.items()}


def tables(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """One row per (task, policy, ratio): both tools' accuracy, seconds per case and KV bytes."""
    a, b = summarize(ours), summarize(theirs)
    table = []
    for key in a:
        task, policy, ratio = key
        dense_a = a.get((task, "dense", 0.0), (0, 0, 0))[2]  # 0: no dense run to divide by (--skip-dense)
        dense_b = b.get((task, "dense", 0.0), (0, 0, 0))[2]
        acc_a, sec_a, kv_a, n = a[key]
        row = {"task": task, "policy": policy, "press": PAIRS.get(policy), "ratio": ratio, "cases": n,
               "accuracy_sparseety": round(acc_a, 4), "seconds_per_case_sparseety": round(sec_a, 3),
               "kv_bytes_sparseety": int(kv_a), "kv_fraction_of_dense_sparseety": round(kv_a / dense_a, 4) if dense_a else None}
        # a variant without a press of its own: its base policy's press rows
        press_key = (task, policy if policy in VARIANT_PRESSES else VARIANTS.get(policy, (policy,))[0], ratio)
        if press_key in b:
            acc_b, sec_b, kv_b, _ = b[press_key]
            row.update({"accuracy_kvpress": round(acc_b, 4), "seconds_per_case_kvpress": round(sec_b, 3),
                        "kv_bytes_kvpress": int(kv_b), "kv_fraction_of_dense_kvpress": round(kv_b / dense_b, 4) if dense_b else None})
            kept = [r["kept_fraction"] for r in theirs if "kept_fraction" in r
                    and (r["task"], r["policy"], r["ratio"]) == press_key]
            if kept:  # a masking press (DMSPress) holds dense KV: the share it left unmasked
                row["kept_fraction_kvpress"] = round(sum(kept) / len(kept), 4)
        table.append(row)
    return table


def targets(table: list[dict]) -> dict:
    """Issue 15's quality targets at ratio 0.5, per task: the best SparSEEty policy (dense excluded) keeps >=
    90% of dense and is >= the best kvpress press; every paired policy is >= its press."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in table):
        rows = [r for r in table if r["task"] == task]
        dense = next((r["accuracy_sparseety"] for r in rows if r["policy"] == "dense"), None)
        half = [r for r in rows if r["ratio"] == 0.5 and r["policy"] != "dense"]
        if not half or dense is None:
            continue
        best = max(half, key=lambda r: r["accuracy_sparseety"])
        presses = [r for r in half if "accuracy_kvpress" in r]
        best_press = max(presses, key=lambda r: r["accuracy_kvpress"]) if presses else None
        out[task] = {
            "dense": dense, "best_sparseety": best["policy"], "best_sparseety_accuracy": best["accuracy_sparseety"],
            "keeps_90pct_of_dense": best["accuracy_sparseety"] >= 0.9 * dense,
            "best_kvpress": best_press["press"] if best_press else None,
            "best_kvpress_accuracy": best_press["accuracy_kvpress"] if best_press else None,
            "best_sparseety_ge_best_kvpress": (best["accuracy_sparseety"] >= best_press["accuracy_kvpress"]
                                               if best_press else None),
            "pairs_ge_kvpress": {r["policy"]: r["accuracy_sparseety"] >= r["accuracy_kvpress"] for r in presses},
        }
    return out


def print_table(table: list[dict]) -> None:
    header = (f"{'task':<15} {'policy':<18} {'ratio':>5} | {'acc ours':>8} {'acc kvp':>7} | "
              f"{'s/case ours':>11} {'s/case kvp':>10} | {'KV MiB ours':>11} {'KV MiB kvp':>10}")
    print(header)
    print("-" * len(header))
    for r in table:
        theirs = r.get("accuracy_kvpress")
        print(f"{r['task']:<15} {r['policy']:<18} {r['ratio']:>5} | {r['accuracy_sparseety']:>8.0%} "
              f"{'-' if theirs is None else f'{theirs:.0%}':>7} | {r['seconds_per_case_sparseety']:>11.2f} "
              f"{r.get('seconds_per_case_kvpress', float('nan')):>10.2f} | {r['kv_bytes_sparseety'] / 2**20:>11.2f} "
              f"{r.get('kv_bytes_kvpress', float('nan')) / 2**20:>10.2f}")


def markdown(document: dict) -> str:
    """Markdown tables of a saved result: accuracy per task (``ours / kvpress`` per policy and ratio), then the
    KV bytes held per policy and ratio (MiB, mean over the cases, ours / kvpress)."""
    table = document["table"]
    ratios = sorted({r["ratio"] for r in table if r["policy"] != "dense"})
    policies = ["dense", *(p for p in dict.fromkeys(r["policy"] for r in table) if p != "dense")]
    cell = {(r["task"], r["policy"], r["ratio"]): r for r in table}

    def pair(r: dict | None, key: str, fmt, n: int | None = None) -> str:
        if r is None:
            return "-"
        ours, theirs = r[f"{key}_sparseety"], r.get(f"{key}_kvpress")
        subset = "" if n is None or r["cases"] == n else f" ({r['cases']} of {n})"
        return fmt(ours) + ("" if theirs is None else " / " + fmt(theirs)) + subset

    pct = lambda v: f"{v:.0%}"  # noqa: E731
    mib = lambda v: f"{v / 2**20:.1f}"  # noqa: E731
    out = []
    for task in dict.fromkeys(r["task"] for r in table):
        n = max(r["cases"] for r in table if r["task"] == task)
        out += [f"**{task}** ({n} cases; SparSEEty / kvpress)", "",
                "| policy (press) | " + " | ".join(f"ratio {x}" for x in [0.0, *ratios]) + " |",
                "|---|" + "---|" * (len(ratios) + 1)]
        for p in policies:
            rows = [cell.get((task, p, x)) for x in [0.0, *ratios]]
            if any(rows):
                name = p if p == "dense" or p not in PAIRS else f"{p} ({PAIRS[p]})"
                if p != "dense" and not any(r and "accuracy_kvpress" in r for r in rows):
                    name = f"{p} (ours only)"
                out.append(f"| {name} | " + " | ".join(pair(r, "accuracy", pct, n) for r in rows) + " |")
        out.append("")
    out += ["**KV held at the end of the answer, as a fraction of dense** (mean over the tasks run; "
            "SparSEEty / kvpress; for kvpress's DMSPress, which masks and holds dense KV, the unmasked share)", "",
            "| policy | " + " | ".join(f"ratio {x}" for x in [0.0, *ratios]) + " |", "|---|" + "---|" * (len(ratios) + 1)]
    for p in policies:
        rows = []
        for x in [0.0, *ratios]:
            group = [r for r in table if r["policy"] == p and r["ratio"] == x
                     and r["kv_fraction_of_dense_sparseety"] is not None]
            if not group:
                rows.append("-")
                continue
            ours = sum(r["kv_fraction_of_dense_sparseety"] for r in group) / len(group)
            theirs = [r.get("kept_fraction_kvpress", r.get("kv_fraction_of_dense_kvpress")) for r in group
                      if r.get("kv_fraction_of_dense_kvpress") is not None]
            rows.append(f"{ours:.3f}" + (f" / {sum(theirs) / len(theirs):.3f}" if theirs else ""))
        out.append(f"| {p} | " + " | ".join(rows) + " |")
    dense = [r for r in table if r["policy"] == "dense"]
    out += ["", "Dense KV per task (MiB, mean over its cases): "
            + ", ".join(f"{r['task']} {mib(r['kv_bytes_sparseety'])}" for r in dense)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--markdown", type=Path, nargs="+", metavar="RESULT_JSON",
                        help="print the tables of saved results (rows of several files merged) as Markdown and exit")
    parser.add_argument("--skip-dense", action="store_true",
                        help="no dense rows (another run on the same cases has them; --markdown merges the files)")
    parser.add_argument("--tasks", default="passkey")
    parser.add_argument("--lengths", default="1000,1500")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--ruler-lengths", default="1000,2000")
    parser.add_argument("--ruler-cases", type=int, default=1)
    parser.add_argument("--ruler-seed", type=int, default=0)
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--policies", default="all",
                        help="comma-separated SparSEEty policies (dense always runs); 'all': every pair plus "
                             + ", ".join(OURS_ONLY))
    parser.add_argument("--kvpress-for", default="all",
                        help="comma-separated policies whose kvpress press also runs ('all': every pair); the others "
                             "run on SparSEEty's side only, to save time where the tools are known to agree")
    parser.add_argument("--max-new-tokens", type=int, default=14, help="passkey answers (RULER: each task's own)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.threads)
        return
    if args.markdown:
        ours, theirs = merged_rows(args.markdown)
        table = tables(ours, theirs)
        print(markdown({"table": table}))
        print()
        print("targets at ratio 0.5:", json.dumps(targets(table), indent=1))
        return

    import torch

    # here, not at the top: the worker runs this file as a script in kvpress's venv (standard library only)
    from benchmarks.common import command, machine, source
    from sparseety.engine import SparseEngine
    from sparseety.models import DEFAULT_MODEL, load_model
    from sparseety.models.registry import resolve_model_dir
    from sparseety.policies import list_policies

    torch.set_num_threads(args.threads)
    ratios = [float(x) for x in args.ratios.split(",")]
    registered = {cls.name for cls in list_policies()}
    wanted = [*PAIRS, *OURS_ONLY] if args.policies == "all" else [p for p in args.policies.split(",") if p]
    policies, skipped = [], {}
    for name in wanted:
        if VARIANTS.get(name, (name,))[0] not in registered:
            skipped[name] = "not registered in this SparSEEty"
        elif name == "learned" and not LEARNED_FILE.is_file():
            skipped[name] = f"{LEARNED_FILE.relative_to(ROOT.parent)} is missing (run benchmarks/learned_policy_bench.py)"
        elif name != "dense":
            policies.append(name)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", file=sys.stderr)
    options = {"learned": {"model": str(LEARNED_FILE)}}
    kvpress_for = set(args.kvpress_for.split(","))

    model, tokenizer = load_model(DEFAULT_MODEL)
    cases = build_cases(args, tokenizer)
    settings = {"tasks": args.tasks, "lengths": args.lengths, "depths": args.depths, "seeds": args.seeds,
                "ruler_lengths": args.ruler_lengths, "ruler_cases": args.ruler_cases, "ruler_seed": args.ruler_seed,
                "ratios": ratios, "policies": policies, "max_new_tokens": args.max_new_tokens,
                "kvpress_for": args.kvpress_for, "skip_dense": args.skip_dense}
    ours, theirs, done = [], [], set()
    if args.resume and args.out.is_file():
        before = json.loads(args.out.read_text())
        if before.get("complete") is False and before.get("settings") == settings:
            ours, theirs = before["rows"]["sparseety"], before["rows"]["kvpress"]
            done = {(r["policy"], r["ratio"]) for r in ours}
            print(f"resuming {args.out}: {len(done)} (policy, ratio) entries done", file=sys.stderr)
        else:
            raise SystemExit(f"error: cannot resume {args.out}: finished, or run with other settings")

    kv_python = ensure_venv()
    engine = SparseEngine(model, tokenizer, DEFAULT_MODEL)
    kvp, worker_start_s = None, 0.0

    def kvpress_worker() -> KvpressWorker:  # started at its first job (never, when no press runs)
        nonlocal kvp, worker_start_s
        if kvp is None:
            t0 = time.perf_counter()
            kvp = KvpressWorker(kv_python, resolve_model_dir(DEFAULT_MODEL), args.threads)
            worker_start_s = time.perf_counter() - t0
        return kvp
    wire = [{k: c[k] for k in ("context_ids", "question_ids", "max_new_tokens", "label")} for c in cases]
    plan = ([] if args.skip_dense else [("dense", 0.0)]) + [(p, r) for r in ratios for p in policies]  # ratio-major: the first ratio complete first
    ours_s = theirs_s = 0.0
    wall = time.perf_counter()

    def save(complete: bool) -> dict:
        table = tables(ours, theirs)
        document = {
            "command": command(), "source": source(),
            "complete": complete, "settings": settings, "model": DEFAULT_MODEL,
            "kvpress_version": kvp.info["kvpress_version"] if kvp else None,
            "kvpress_transformers_version": kvp.info["transformers_version"] if kvp else None, "threads": args.threads,
            "skipped": skipped, "pairs": PAIRS, "machine": machine(),
            "cases": [{k: v for k, v in c.items() if k not in ("context_ids", "question_ids", "label")}
                      | {"context_tokens": len(c["context_ids"])} for c in cases],
            "wall_seconds": {"sparseety": round(ours_s, 1), "kvpress": round(theirs_s, 1),
                             "kvpress_worker_start": round(worker_start_s, 1),
                             "total": round(time.perf_counter() - wall, 1)},
            "targets_at_ratio_0.5": targets(table), "table": table, "rows": {"sparseety": ours, "kvpress": theirs},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(json.dumps(document, indent=1))
        os.replace(tmp, args.out)
        return document

    try:
        for name, ratio in plan:
            if (name, ratio) in done:
                continue
            t0 = time.perf_counter()
            ours += sparseety_side(engine, cases, name, ratio, options.get(name), args.threads)
            ours_s += time.perf_counter() - t0
            press = None if name == "dense" else PAIRS.get(name)
            if name == "dense" or (press is not None and (args.kvpress_for == "all" or name in kvpress_for)):
                t0 = time.perf_counter()
                got = kvpress_worker().run(press, ratio, wire)
                theirs_s += time.perf_counter() - t0
                theirs += [row_of(c, name, ratio, g["answer"], g["seconds"], g["kv_bytes"], g.get("kept_fraction"))
                           for c, g in zip(cases, got)]
            save(complete=False)
    finally:
        if kvp is not None:
            kvp.close()
    document = save(complete=True)
    print_table(document["table"])
    for task, t in document["targets_at_ratio_0.5"].items():
        print(f"{task}: best SparSEEty {t['best_sparseety']} {t['best_sparseety_accuracy']:.0%} "
              f"(dense {t['dense']:.0%}, >= 90%: {t['keeps_90pct_of_dense']}), best kvpress {t['best_kvpress']} "
              f"{t['best_kvpress_accuracy'] if t['best_kvpress_accuracy'] is None else format(t['best_kvpress_accuracy'], '.0%')}"
              f" (>=: {t['best_sparseety_ge_best_kvpress']}); pairs >= kvpress: "
              f"{', '.join(k for k, v in t['pairs_ge_kvpress'].items() if v) or 'none'}; below: "
              f"{', '.join(k for k, v in t['pairs_ge_kvpress'].items() if not v) or 'none'}")
    print(f"saved {args.out} ({document['wall_seconds']})")


if __name__ == "__main__":
    main()
