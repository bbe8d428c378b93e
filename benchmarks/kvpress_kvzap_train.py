"""Train kvpress's own ``KVzapModel`` (its ``kvzap/train.py`` code) on the texts SparSEEty's shipped ``kvzap``
surrogate was trained on, and calibrate both sides' DMS thresholds.

Usage (from the repository root, after ``python -m sparseety.training.shipped_policies`` built the training
traces)::

    .venv/bin/python -m benchmarks.kvpress_kvzap_train [--traces build/shipped_policies/smollm2-135m]
        [--requests 26] [--out benchmarks/results/kvpress_kvzap_train] [--surrogates linear,mlp] [--n-tokens 500]
        [--threads 1]

Same texts, same split. The training traces' prompts (``--requests 26``: the first 26, the shipped
``kvzap-linear-smollm2-135m`` surrogate's set, as :mod:`sparseety.training.shipped_policies` says) are the
contexts ``sparseety learn-policy --target kvzip`` reads; the user turn of each (the document, then the
question) is handed to kvpress as text, and requests are split into training and held-out ones exactly as
``learn-policy`` splits them (:func:`sparseety.training.learned_policy.split_requests`, hold-out 0.25, seed 0).
The Nemotron download that ``kvzap/train.py`` would make is the only part replaced.

kvpress side (``benchmarks/.kvpress-venv``, see ``benchmarks/kvpress_compare.py``; this script adds
``scikit-learn`` and ``skorch`` to it, which ``kvzap/train.py`` imports). kvpress's ``kvzap/`` folder does
not ship in its wheel, so it is vendored unmodified in ``benchmarks/third_party/kvzap`` (see its
``SOURCE.md``). The worker builds the ``DataFrame`` ``load_nemotron_dataset`` would return (held-out rows
first, as there), runs ``KVzapDataCollector.collect`` (KVzip+ scores from the chat-template repeat prompt,
``n_tokens`` random tokens per text), then ``train_linear`` (``sklearn`` ``Ridge()`` per layer) and, with
``mlp``, ``train_mlp`` (skorch, its defaults: width 512, 15 epochs, lr 5e-3) on CPU in float32, and saves
each with ``save_pretrained`` as ``train.py`` does (``<out>/linear``, ``<out>/mlp``).

Both sides are then measured the same way on the held-out texts' sampled tokens: Spearman per layer over
(token, KV head) pairs and recall of the true top half per KV head (``learn-policy``'s figures). The DMS
thresholds for ``DMSPress(KVzapPress, threshold)`` and ``kvzap threshold=T`` at the benchmark's ratios are
the quantiles of each side's predicted scores over the held-out tokens (every layer and KV head): at
threshold ``q_r``, a fraction ``r`` of the pairs score below it. That is DMS's memory (each head keeps its
own tokens), not SparSEEty's threshold mode's, where every head of a layer keeps as many slots as its busiest
head: ``layer_thresholds`` are the thresholds at which that rule holds ``1 - r`` of the tokens on the same
held-out texts (equal memory). Saved to ``<out>/summary.json``, which ``benchmarks/kvpress_compare.py`` reads;
``--sparseety-only`` re-measures SparSEEty's side and keeps the kvpress side of an existing one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
THIRD_PARTY = ROOT / "third_party"
OUT = ROOT / "results" / "kvpress_kvzap_train"
TRACES = ROOT.parent / "build" / "shipped_policies" / "smollm2-135m"
RATIOS = (0.25, 0.5, 0.75, 0.875)


# -- kvpress side (runs inside benchmarks/.kvpress-venv) ---------------------------------------------------

def worker(texts_file: str, out_dir: str, model_dir: str, surrogates: list[str], n_tokens: int, threads: int) -> None:
    import types

    import numpy as np
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    # data.py imports FP8Linear, whose module needs triton (absent on CPU); the fp32 path never uses it.
    stub = types.ModuleType("transformers.integrations.finegrained_fp8")
    stub.FP8Linear = type("FP8Linear", (), {})
    sys.modules.setdefault("transformers.integrations.finegrained_fp8", stub)
    # kvpress's kvzap/ folder, vendored unmodified as a source tree (not a package of ours, absent from kvpress's
    # wheel): this worker runs in kvpress's venv, where only this path makes its own ``kvzap.*`` imports resolve
    sys.path.insert(0, str(THIRD_PARTY))
    from kvzap.data import KVzapDataCollector
    from kvzap.train import train_linear, train_mlp

    rows = [json.loads(line) for line in Path(texts_file).read_text().splitlines()]
    df = pd.DataFrame(rows)
    df = pd.concat([df[df["split"] == "test"], df[df["split"] == "train"]]).reset_index(drop=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    X, y = KVzapDataCollector(model, tokenizer).collect(df, n_tokens)
    collect_s = time.perf_counter() - t0
    n_test = n_tokens * int((df["split"] == "test").sum())
    X_train, X_test, y_train, y_test = X[n_test:], X[:n_test], y[n_test:], y[:n_test]
    out = Path(out_dir)
    report = {"collect_seconds": round(collect_s, 1), "train_tokens": int(X_train.shape[0]),
              "test_tokens": int(X_test.shape[0]), "n_tokens_per_text": n_tokens, "surrogates": {}}
    for name in surrogates:
        t0 = time.perf_counter()
        module = train_linear(X_train, y_train) if name == "linear" else train_mlp(X_train, y_train, 512, "cpu", 15, 5e-3, 512)
        fit_s = time.perf_counter() - t0
        with torch.no_grad():
            pred = module(X_test).float()
        module.save_pretrained(out / name)
        np.save(out / name / "true.npy", y_test.float().numpy())
        np.save(out / name / "pred.npy", pred.numpy())
        report["surrogates"][name] = {"fit_seconds": round(fit_s, 1), "weights": sum(p.numel() for p in module.parameters()),
                                      **fidelity(pred, y_test.float(), n_tokens)}
    print(json.dumps(report), flush=True)


# -- shared figures (both venvs: torch only) ----------------------------------------------------------------

def fidelity(pred, true, per_text: int) -> dict:
    """Held-out fidelity of predictions ``[N, layers, kv_heads]`` to ``true`` (rows grouped ``per_text`` per
    text): per layer, Spearman over each text's (token, head) pairs and recall of the true top half per
    head, each averaged over the texts; and the predicted scores' quantiles at :data:`RATIOS`."""
    import torch

    def ranks(x):
        return x.argsort().argsort().double()

    def spearman(a, b):
        ra, rb = ranks(a), ranks(b)
        ra, rb = ra - ra.mean(), rb - rb.mean()
        return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp(min=1e-12))

    layers = pred.shape[1]
    rho, recall = [[] for _ in range(layers)], [[] for _ in range(layers)]
    for first in range(0, pred.shape[0], per_text):
        p, t = pred[first : first + per_text], true[first : first + per_text]
        keep = max(1, p.shape[0] // 2)
        for layer in range(layers):
            rho[layer].append(spearman(p[:, layer].reshape(-1), t[:, layer].reshape(-1)))
            for head in range(p.shape[2]):
                chosen = torch.zeros(p.shape[0], dtype=torch.bool)
                chosen[p[:, layer, head].topk(keep).indices] = True
                recall[layer].append(float(chosen[t[:, layer, head].topk(keep).indices].float().mean()))
    per_layer = [{"layer": i, "spearman": round(sum(rho[i]) / len(rho[i]), 4),
                  "recall@0.5": round(sum(recall[i]) / len(recall[i]), 4)} for i in range(layers)]
    flat = pred.reshape(-1).float()
    return {"heldout_mean": {key: round(sum(r[key] for r in per_layer) / layers, 4) for key in ("spearman", "recall@0.5")},
            "heldout": per_layer,
            "thresholds": {str(r): round(float(torch.quantile(flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:1_000_000]], r)), 4)
                           for r in RATIOS},
            "layer_thresholds": {str(r): round(layer_threshold(pred, per_text, r), 4) for r in RATIOS}}


def layer_threshold(pred, per_text: int, ratio: float) -> float:
    """The threshold at which SparSEEty's threshold mode holds ``1 - ratio`` of the tokens: a layer keeps, per
    KV head, as many as its busiest head scores at or above it, so its kept share is that head's share;
    averaged over the layers and texts (``pred`` ``[N, layers, kv_heads]``, ``per_text`` rows a text). Bisection."""
    texts = pred.float().reshape(-1, per_text, pred.shape[1], pred.shape[2])  # [texts, tokens, layers, heads]

    def kept(t: float) -> float:
        return float((texts >= t).float().mean(dim=1).amax(dim=-1).mean())

    low, high = float(pred.min()), float(pred.max()) + 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if kept(mid) > 1 - ratio else (low, mid)
    return (low + high) / 2


# -- SparSEEty side (runs in SparSEEty's .venv) --------------------------------------------------------------

def user_text(tokenizer, ids: list[int]) -> str:
    """The user turn of a traced prompt (document, blank line, question): the ids between the chat template's
    prefix and its suffix (:func:`sparseety.policies.kvzip.template_parts`), decoded."""
    from sparseety.policies.kvzip import template_parts

    prefix, suffix = template_parts(tokenizer)
    if ids[: len(prefix)] != prefix or ids[len(ids) - len(suffix):] != suffix:
        raise SystemExit("error: a traced prompt does not start and end with the chat template's user turn")
    return tokenizer.decode(ids[len(prefix): len(ids) - len(suffix)])


def ensure_training_deps(python: Path) -> None:
    probe = [str(python), "-c", "import sklearn, skorch, pandas, datasets, fire"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "scikit-learn", "skorch", "pandas", "datasets", "fire", "torch==2.13.0"], check=True)


def ours(engine, contexts, held: list[int], per_text: int) -> dict:
    """SparSEEty's shipped surrogate on the held-out contexts, ``per_text`` tokens of each sampled as kvpress
    samples them (one seeded ``randperm`` per text), scored with :func:`fidelity`."""
    import torch

    from sparseety.training.kvzap_surrogate import capture
    from sparseety.policies.parts.kvzap_model import load_surrogate
    from sparseety.policies.parts.learned_model import shipped_file

    path = shipped_file("kvzap-linear-", engine.model_info)
    surrogate = load_surrogate(path)
    preds, trues = [], []
    generator = torch.Generator().manual_seed(0)
    for index in held:
        captured = capture(engine, contexts[index])
        c = captured[0][0].shape[0]
        pick = torch.randperm(c, generator=generator)[: min(per_text, c)]
        if pick.numel() < per_text:
            raise SystemExit(f"error: held-out context {contexts[index].request_id} has {c} tokens, fewer than "
                             f"--n-tokens {per_text}")
        preds.append(torch.stack([surrogate(layer, x.unsqueeze(0))[0].T[pick] for layer, (x, _) in sorted(captured.items())], 1))
        trues.append(torch.stack([y.T[pick] for _, (_, y) in sorted(captured.items())], 1))
    return {"file": path.name, **fidelity(torch.cat(preds), torch.cat(trues), per_text),
            "provenance_heldout_mean": surrogate.provenance.get("heldout_mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("TEXTS", "OUT", "MODEL_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--requests", type=int, default=0,
                        help="use the first N traced prompts only (0: all); 26 reproduces the shipped surrogate's set")
    parser.add_argument("--surrogates", default="linear")
    parser.add_argument("--n-tokens", type=int, default=500, help="tokens sampled per text (kvzap/train.py's n_tokens)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sparseety-only", action="store_true",
                        help="keep the kvpress side of an existing <out>/summary.json; re-measure SparSEEty's side only")
    args = parser.parse_args()
    surrogates = [s for s in args.surrogates.split(",") if s]
    if args.worker:
        worker(*args.worker, surrogates, args.n_tokens, args.threads)
        return

    import torch

    # here, not at the top: the worker runs this file as a script in kvpress's venv (standard library only)
    from benchmarks.common import command, machine, source
    from benchmarks.kvpress_compare import ensure_venv
    from sparseety.training.kvzap_surrogate import KVzapConfig, read_contexts
    from sparseety.training.learned_policy import split_requests
    from sparseety.engine import SparseEngine
    from sparseety.models import DEFAULT_MODEL, load_model
    from sparseety.models.registry import resolve_model_dir

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL)
    contexts = read_contexts(args.traces, DEFAULT_MODEL, KVzapConfig().max_context)
    contexts = contexts[: args.requests] if args.requests else contexts
    train, held = split_requests(contexts, KVzapConfig().holdout, KVzapConfig().seed)  # type: ignore[arg-type]
    engine = SparseEngine(model, tokenizer, DEFAULT_MODEL)
    if args.sparseety_only:
        summary = json.loads((args.out / "summary.json").read_text())
        summary["sparseety"] = ours(engine, contexts, held, args.n_tokens)
        summary["sparseety_command"] = command()
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: summary["sparseety"][k] for k in ("heldout_mean", "thresholds", "layer_thresholds")}))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("linear", "mlp"):  # save_pretrained refuses nothing; an old model must not survive a failed run
        shutil.rmtree(args.out / stale, ignore_errors=True)
    texts = args.out / "texts.jsonl"
    texts.write_text("".join(json.dumps({"request_id": c.request_id, "split": "test" if i in held else "train",
                                         "text": user_text(tokenizer, c.token_ids)}) + "\n"
                             for i, c in enumerate(contexts)))
    python = ensure_venv()
    ensure_training_deps(python)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error"}
    t0 = time.perf_counter()
    got = subprocess.run([str(python), __file__, "--worker", str(texts), str(args.out), resolve_model_dir(DEFAULT_MODEL),
                          "--surrogates", args.surrogates, "--n-tokens", str(args.n_tokens), "--threads", str(args.threads)],
                         env=env, stdout=subprocess.PIPE, text=True, check=True)
    kvpress = json.loads(got.stdout.strip().splitlines()[-1]) | {"wall_seconds": round(time.perf_counter() - t0, 1)}
    summary = {
        "command": command(), "source": source(), "machine": machine(),
        "model": DEFAULT_MODEL, "traces": str(args.traces), "requests": len(contexts),
        "train_requests": len(train), "heldout_requests": len(held),
        "kvpress": kvpress, "sparseety": ours(engine, contexts, held, args.n_tokens),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for side in ("sparseety", "kvpress"):
        for name, figures in ([("linear", summary["sparseety"])] if side == "sparseety"
                              else summary["kvpress"]["surrogates"].items()):
            print(f"{side} {name}: held-out Spearman {figures['heldout_mean']['spearman']:.3f}, recall@0.5 "
                  f"{figures['heldout_mean']['recall@0.5']:.3f}; thresholds {figures['thresholds']}")
    print(f"saved {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
