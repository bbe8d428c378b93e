"""Train the ``learned`` policy on one text source and evaluate it on passkey cases built from another.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.learned_policy_bench [--train-cases 64] [--lengths 1000,1500,2000]
                                                  [--depths 0.1,0.5,0.9] [--seeds 0,1,2,3] [--ratio 0.5]

1. **Training traces** (``benchmarks/results/learned_policy/traces``): retrieval questions about
   documents made of sentences of *Python's own docstrings* (the standard library modules listed in
   ``DOC_MODULES``, read with ``inspect.getdoc``; no license text). Each case hides one fact (an access
   code, a room number, a favourite number, a secret word, a hiding place, with its own wording; never
   the evaluation's "pass key" sentence) at a seeded depth, or asks for a one-sentence summary; it is
   run with the ``dense`` policy at tier 3 under the long-document protocol and stored exactly as
   ``sparseety run --context-file F --question Q --policy dense --tier 3 --trace-dir DIR`` stores it.
2. **Training**: ``sparseety learn-policy DIR -o policy.safetensors --text-source ...`` (its held-out
   ranking metrics are on requests it did not train on, from the same source).
3. **Evaluation** on the held-out source: the passkey cases of ``sparseety bench passkey``
   (haystacks of ``/usr/share/common-licenses``, the needle "The pass key is N. Remember it."), for
   ``dense``, ``learned``, ``h2o`` and ``tova`` at ``--ratio``, the context compressed, the question not.

Saves ``benchmarks/results/learned_policy/learned_policy.json`` (``learned_policy<TAG>.json`` with ``--tag``). One torch thread (see DESIGN.md).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "learned_policy"
WORK = OUT
DOC_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
               "datetime", "decimal", "email.message", "fractions", "functools", "heapq", "http.client",
               "inspect", "ipaddress", "itertools", "json", "logging", "pathlib", "pickle", "queue", "random",
               "sched", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
               "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.request", "uuid", "zipfile")
WORDS = ("lantern", "harbor", "violet", "granite", "falcon", "meadow", "copper", "willow", "saffron", "glacier")
PLACES = ("old oak tree", "red bridge", "stone well", "garden shed", "lighthouse", "north gate")
FACTS = (
    ("The access code is {n}. Keep it safe.", "What is the access code?", "n"),
    ("The meeting is in room {n} this week.", "Which room is the meeting in?", "n"),
    ("My favourite number is {n}, for the record.", "What is my favourite number?", "n"),
    ("The secret word is {w}. Do not forget it.", "What is the secret word?", "w"),
    ("The treasure is hidden under the {p}.", "Where is the treasure hidden?", "p"),
)
SUMMARY = "Summarize the text above in one sentence."


def doc_sentences() -> list[str]:
    """Sentences of the docstrings of ``DOC_MODULES`` and their public members (deterministic order)."""
    texts = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(module, attr, None))
            if doc and getattr(getattr(module, attr, None), "__module__", name) == name:
                texts.append(doc)
    text = re.sub(r"\s+", " ", " ".join(t for t in texts if ">>>" not in t))
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text)
                 if 5 <= len(s.split()) <= 80 and sum(c.isalpha() for c in s) > 0.7 * len(s)]
    return list(dict.fromkeys(sentences))  # first occurrence of each sentence


def training_case(sentences: list[str], index: int, count_tokens, length: int) -> tuple[str, str, str]:
    """(context, question, answer) of training case ``index``: about ``length`` tokens of docstring text."""
    rng = random.Random(f"learned-train:{index}")
    start = rng.randrange(len(sentences))
    chosen, total, i = [], 0, start
    while total < length:
        sentence = sentences[i % len(sentences)]
        chosen.append(sentence)
        total += count_tokens(" " + sentence)
        i += 1
    if index % 4 == 3:
        return " ".join(chosen), SUMMARY, ""
    template, question, kind = FACTS[index % len(FACTS)]
    value = {"n": str(rng.randint(100, 9_999_999)), "w": rng.choice(WORDS), "p": rng.choice(PLACES)}[kind]
    cut = int(rng.uniform(0.05, 0.95) * len(chosen))
    return " ".join([*chosen[:cut], template.format(n=value, w=value, p=value), *chosen[cut:]]), question, value


def build_traces(engine, tokenizer, cases: int, trace_dir: Path, lengths: list[int]) -> list[dict]:
    from sparseety.engine import encode_document
    from sparseety.policies import build_policy
    from sparseety.store import write_trace

    sentences = doc_sentences()
    counter = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rows = []
    for index in range(cases):
        context, question, answer = training_case(sentences, index, counter, lengths[index % len(lengths)])
        encoded = encode_document(tokenizer, context, question, None)
        start = time.perf_counter()
        result = engine.generate(encoded, build_policy("dense"), max_new_tokens=16, tier=3)
        write_trace(result, trace_dir)
        rows.append({"request_id": result.request_id, "context_tokens": encoded.compress_len, "question": question,
                     "answer": answer, "output": result.text, "seconds": round(time.perf_counter() - start, 2)})
        print(f"[trace {index + 1}/{cases}] {encoded.compress_len} tokens, {question!r} -> {result.text.strip()[:40]!r}",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-cases", type=int, default=64)
    parser.add_argument("--train-lengths", default="600,900,1200")
    parser.add_argument("--lengths", default="1000,1500,2000")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--policies", default="dense,learned,h2o,tova")
    parser.add_argument("--label", default="max", help="learn-policy --label (max, sum or question)")
    parser.add_argument("--label-top", type=float, default=0.02, help="learn-policy --label-top")
    parser.add_argument("--tag", default="", help="suffix of the policy file and the result JSON (a variant); the "
                        "traces are shared: without --reuse-traces a tagged run rebuilds them, replacing those the "
                        "untagged policy was trained on")
    parser.add_argument("--reuse-traces", action="store_true", help="keep the traces (and policy) already built")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from sparseety.suites import make_cases, tokenizer_counter
    from sparseety.suites.passkey_run import answer_case
    from sparseety.engine import SparseEngine
    from sparseety.models import DEFAULT_MODEL, load_model

    lm, tokenizer = load_model(DEFAULT_MODEL)
    engine = SparseEngine(lm, tokenizer, DEFAULT_MODEL)
    trace_dir, policy_file = WORK / "traces", WORK / f"policy{args.tag}.safetensors"
    target = OUT / f"learned_policy{args.tag}.json"
    document: dict = {"model": DEFAULT_MODEL, "train_source": "Python standard-library docstrings "
                      f"({len(DOC_MODULES)} modules, inspect.getdoc)", "eval_source": "/usr/share/common-licenses "
                      "(sparseety bench passkey cases)"}
    started = time.perf_counter()
    if not (args.reuse_traces and trace_dir.exists()):
        if trace_dir.exists():
            import shutil

            shutil.rmtree(trace_dir)
        document["train_traces"] = build_traces(engine, tokenizer, args.train_cases, trace_dir,
                                                [int(x) for x in args.train_lengths.split(",")])
    document["trace_seconds"] = round(time.perf_counter() - started, 1)
    if not (args.reuse_traces and policy_file.exists()):
        command = [str(Path(sys.executable).parent / "sparseety"), "learn-policy", str(trace_dir), "-o", str(policy_file),
                   "--epochs", str(args.epochs), "--label", args.label, "--label-top", str(args.label_top),
                   "--text-source", document["train_source"], "--json"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
        if done.returncode != 0:
            raise SystemExit(f"learn-policy failed: {done.stderr}")
        document["learn_policy"] = json.loads(done.stdout)
        print(json.dumps(document["learn_policy"]["metrics"], indent=1), flush=True)
    earlier = target
    if args.reuse_traces and earlier.exists():
        before = json.loads(earlier.read_text())
        for key in ("train_traces", "learn_policy"):
            if key in before:
                document.setdefault(key, before[key])
    document["learn_command"] = (f".venv/bin/sparseety learn-policy {trace_dir.relative_to(ROOT)} -o "
                                 f"{policy_file.relative_to(ROOT)} --epochs {args.epochs} --label {args.label} "
                                 f"--label-top {args.label_top} --text-source ...")

    cases = [c for seed in (int(s) for s in args.seeds.split(","))
             for c in make_cases([int(x) for x in args.lengths.split(",")],
                                 [float(x) for x in args.depths.split(",")], seed, tokenizer_counter(tokenizer))]
    previous = target
    results = []
    if args.reuse_traces and previous.exists():  # keep the other policies' answers of the run before
        names = set(args.policies.split(","))
        results = [r for r in json.loads(previous.read_text()).get("results", []) if r["policy"] not in names]
    for name in args.policies.split(","):
        options = {"model": str(policy_file)} if name == "learned" else {}
        for i, case in enumerate(cases):
            row = answer_case(engine, case, name, 0.0 if name == "dense" else args.ratio, options=options)
            results.append({**row.__dict__, "case": i})
            print(f"[{name} {i + 1}/{len(cases)}] length={case.length} depth={case.depth}: "
                  f"{'ok' if row.correct else 'miss'} {row.answer.strip()[:30]!r}", flush=True)
            document["results"] = results
            document["accuracy"] = {p: round(sum(r["correct"] for r in results if r["policy"] == p)
                                             / max(1, sum(r["policy"] == p for r in results)), 4)
                                    for p in dict.fromkeys(r["policy"] for r in results)}
            target.write_text(json.dumps(document, indent=1))
    document["eval"] = {"ratio": args.ratio, "cases": len(cases), "lengths": args.lengths, "depths": args.depths,
                        "seeds": args.seeds}
    document["seconds"] = round(time.perf_counter() - started, 1)
    target.write_text(json.dumps(document, indent=1))
    print(json.dumps(document["accuracy"], indent=1))


if __name__ == "__main__":
    main()
