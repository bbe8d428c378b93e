"""Where RULER's needles go under uniform budgets: the shipped ``kvzap`` surrogate against the true KVzip+ scores.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.studies.kvzap_needles [--tasks niah_single,niah_multivalue] [--lengths 1000,2000]
        [--cases 3] [--seed 0] [--ratio 0.5] [--out benchmarks/results/studies/kvzap_needles.json]

For each case (the cases of ``.venv/bin/python -m benchmarks.kvpress_compare --ruler-cases 3``), one dense teacher-forced
pass (:func:`sparseety.training.kvzap_surrogate.capture`, KVzip's reconstruction prompt) gives every layer's
hidden states and true log KVzip+ scores of the context tokens. Per layer and KV head, each score (the
surrogate's prediction, or the truth) keeps its top ``1 - ratio`` of the context, as ``kvzap`` does with
uniform budgets. A needle is *kept whole* by a head when every token of its value is kept. Printed and
saved: per layer, the share of (needle, KV head) pairs kept whole, by prediction and by truth, averaged
over the cases. Equal shares say the surrogate drops needles where the true scores would too, so uniform
budgets, not the surrogate, lose them. One torch thread.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import command

OUT = Path(__file__).resolve().parents[1] / "results" / "studies" / "kvzap_needles.json"


def value_spans(tokenizer, ids: list[int], values) -> list[list[int]]:
    """Per needle value, the context positions of the tokens that spell it (values not found are skipped)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + len(piece))
    text = "".join(pieces)
    spans = []
    for value in values:
        at = text.find(value)
        if at >= 0:
            spans.append([k for k in range(len(ids)) if starts[k] < at + len(value) and starts[k + 1] > at])
    return spans


def shipped_surrogate():
    """``(engine, tokenizer, surrogate file, surrogate)``: the default model (one torch thread) and the ``kvzap``
    linear surrogate shipped for it."""
    import torch

    from sparseety.engine import SparseEngine
    from sparseety.models import DEFAULT_MODEL, load_model
    from sparseety.policies.parts.kvzap_model import load_surrogate
    from sparseety.policies.parts.learned_model import shipped_file

    torch.set_num_threads(1)
    model, tokenizer = load_model(DEFAULT_MODEL)
    engine = SparseEngine(model, tokenizer, DEFAULT_MODEL)
    path = shipped_file("kvzap-linear-", engine.model_info)
    return engine, tokenizer, path, load_surrogate(path)


def kept_whole(scores, spans: list[list[int]], ratio: float) -> float:
    """Share of (needle, KV head) pairs whose value tokens all fall in the head's top ``1 - ratio`` (``scores``
    ``[kv_heads, c]``)."""
    import torch

    keep = max(1, int(scores.shape[1] * (1 - ratio)))
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(keep, dim=-1).indices, True)
    return sum(float(kept[:, span].all(dim=-1).float().mean()) for span in spans) / len(spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="niah_single,niah_multivalue")
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--cases", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    from sparseety.training.kvzap_surrogate import Context, capture
    from sparseety.suites.passkey import tokenizer_counter
    from sparseety.suites.ruler import encode_case, make_ruler_case
    from sparseety.models import DEFAULT_MODEL

    engine, tokenizer, path, surrogate = shipped_surrogate()
    count = tokenizer_counter(tokenizer)

    cases = []
    for task in args.tasks.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            for index in range(args.cases):
                case = make_ruler_case(task, length, index, args.seed, count)
                encoded = encode_case(tokenizer, case, None)
                ids = encoded.input_ids[0].tolist()[: encoded.compress_len]
                captured = capture(engine, Context(request_id=f"{task}-{length}-{index}", model=DEFAULT_MODEL, token_ids=ids))
                scored_from = len(ids) - captured[0][0].shape[0]  # the chat template's header is not scored
                spans = [[k - scored_from for k in span if k >= scored_from]
                         for span in value_spans(tokenizer, ids, case.expected)]
                spans = [span for span in spans if span]
                if not spans:
                    raise SystemExit(f"error: no needle value found in {task} length {length} case {index}")
                per_layer = {"predicted": [], "true": []}
                for layer in sorted(captured):
                    x, y = captured[layer]
                    per_layer["predicted"].append(round(kept_whole(surrogate(layer, x.unsqueeze(0))[0], spans, args.ratio), 3))
                    per_layer["true"].append(round(kept_whole(y, spans, args.ratio), 3))
                cases.append({"task": task, "length": length, "index": index, "needles": len(spans), **per_layer})
                print(f"{task} {length} case {index}: kept whole, mean over layers: predicted "
                      f"{sum(per_layer['predicted']) / len(per_layer['predicted']):.3f}, true "
                      f"{sum(per_layer['true']) / len(per_layer['true']):.3f}", flush=True)
    layers = len(cases[0]["true"])
    mean = {side: [round(sum(c[side][layer] for c in cases) / len(cases), 3) for layer in range(layers)]
            for side in ("predicted", "true")}
    argv = [x for k, v in vars(args).items() if k != "out" for x in (f"--{k.replace('_', '-')}", str(v))]
    doc = {"command": command(argv),
           "surrogate": path.name, "ratio": args.ratio, "cases": cases, "per_layer_mean": mean,
           "mean": {side: round(sum(v) / layers, 3) for side, v in mean.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    for side in ("predicted", "true"):
        print(f"{side:>9}: " + " ".join(f"{v:.2f}" for v in mean[side]) + f"  (mean {doc['mean'][side]:.3f})")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
