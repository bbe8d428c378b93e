"""How well the shipped ``kvzap`` surrogate's levels allocate a budget: within a layer's heads, and across layers.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.studies.kvzap_levels [--cases 6] [--ratio 0.5] [--out benchmarks/results/studies/kvzap_levels.json]

Three kinds of context, ``--cases`` each, none of them trained on:

- ``docstrings``: prompts of the kind the shipped surrogate was fitted on (``benchmarks/learned_policy_bench.py``
  training cases, at indices 1000 and up; the surrogate saw indices 0-25);
- ``passkey``: the passkey cases of ``benchmarks/kvpress_compare.py`` (license text), seed 4;
- ``multikey``: its niah_multikey cases, RULER seed 1.

Per context, one dense teacher-forced pass (:func:`sparseety.training.kvzap_surrogate.capture`) gives every
layer's hidden states and the true log KVzip+ score of every (layer, KV head, token); the surrogate predicts
the same from the hidden states. A budget of ``1 - ratio`` of the context is then allocated three ways, each
once by the predictions and once by the truth:

- ``uniform``: each (layer, KV head) keeps its best ``1 - ratio`` (``kvzap per_head=false``);
- ``within_layer``: each layer keeps ``1 - ratio`` of its (head, token) scores, one cut over its heads
  (``kvzap``'s default, ``kvzip_layerwise``);
- ``across_layers``: one cut over every (layer, head, token) score (``kvzip``'s default, ``kvzap_share_heads``).

Printed and saved per kind: the recall of the truth's kept set by the prediction's (under each allocation), and
how much of the budget the prediction puts in the wrong layer (across layers: half the summed difference of
the layers' kept counts, over the budget) or the wrong head (within a layer, averaged over the layers). For the
passkey and multikey contexts also, per allocation and for the prediction and the truth, the share of (layer, KV
head) pairs that keep the answer (the pass key, or the value asked for) whole: every token that spells it is
kept. One torch thread.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import command

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/
OUT = ROOT / "results" / "studies" / "kvzap_levels.json"
ALLOCATIONS = ("uniform", "within_layer", "across_layers")


def kept(scores, keep: float, allocation: str):
    """``[L, H, c]`` bool: what ``allocation`` keeps of ``scores`` ``[L, H, c]`` with a budget of ``keep`` of it."""
    import torch

    layers, heads, c = scores.shape
    dims = {"uniform": (layers * heads, c), "within_layer": (layers, heads * c), "across_layers": (1, layers * heads * c)}
    flat = scores.reshape(dims[allocation])
    k = max(1, int(flat.shape[1] * keep))
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, flat.topk(k, dim=1).indices, True)
    return mask.reshape(layers, heads, c)


def measure(predicted, true, keep: float) -> dict[str, float]:
    """Recall of the truth's kept set per allocation, and the budget share placed in the wrong layer / head."""
    out: dict[str, float] = {}
    for allocation in ALLOCATIONS:
        p, t = kept(predicted, keep, allocation), kept(true, keep, allocation)
        out[f"recall_{allocation}"] = float((p & t).sum() / t.sum())
    p, t = kept(predicted, keep, "across_layers"), kept(true, keep, "across_layers")
    out["wrong_layer_share"] = float((p.sum(dim=(1, 2)) - t.sum(dim=(1, 2))).abs().sum() / 2 / t.sum())
    p, t = kept(predicted, keep, "within_layer"), kept(true, keep, "within_layer")
    out["wrong_head_share"] = float(((p.sum(dim=2) - t.sum(dim=2)).abs().sum(dim=1) / 2 / t.sum(dim=(1, 2))).mean())
    return out


def answer_kept(predicted, true, keep: float, span: list[int]) -> dict[str, float]:
    """Per allocation, the share of (layer, KV head) pairs keeping every context token of ``span`` (scored
    positions), by the prediction and by the truth."""
    out: dict[str, float] = {}
    for allocation in ALLOCATIONS:
        for side, scores in (("predicted", predicted), ("true", true)):
            out[f"answer_{allocation}_{side}"] = float(kept(scores, keep, allocation)[:, :, span].all(dim=-1).float().mean())
    return out


def contexts(tokenizer, cases: int) -> dict[str, list[tuple[list[int], tuple[str, ...]]]]:
    """Per kind, ``cases`` contexts: token ids (the question is not part of them) and the answer's strings
    (none for the docstring prompts)."""
    from benchmarks.learned_policy_bench import doc_sentences, training_case

    from sparseety.suites.passkey import make_case, tokenizer_counter
    from sparseety.suites.ruler import encode_case, make_ruler_case
    from sparseety.engine import encode_document

    count = tokenizer_counter(tokenizer)
    lengths = (1000, 1500, 2000)
    sentences = doc_sentences()
    out: dict[str, list[tuple[list[int], tuple[str, ...]]]] = {"docstrings": [], "passkey": [], "multikey": []}
    for i in range(cases):
        context, question, _ = training_case(sentences, 1000 + i, count, lengths[i % 3])
        encoded = encode_document(tokenizer, context, question, None)
        out["docstrings"].append((encoded.input_ids[0].tolist()[: encoded.compress_len], ()))
        case = make_case(lengths[i % 3], (0.1, 0.5, 0.9)[i // 3 % 3], 4, count)
        encoded = encode_document(tokenizer, case.context, "What is the pass key?", None)
        out["passkey"].append((encoded.input_ids[0].tolist()[: encoded.compress_len], (case.passkey,)))
        ruler = make_ruler_case("niah_multikey", (1000, 2000)[i % 2], i // 2, 1, count)
        encoded = encode_case(tokenizer, ruler, None)
        out["multikey"].append((encoded.input_ids[0].tolist()[: encoded.compress_len], tuple(ruler.expected)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    import torch

    from benchmarks.studies.kvzap_needles import shipped_surrogate, value_spans

    from sparseety.training.kvzap_surrogate import Context, capture
    from sparseety.models import DEFAULT_MODEL

    engine, tokenizer, path, surrogate = shipped_surrogate()
    result: dict[str, object] = {"command": command(),
                                 "surrogate": path.name, "ratio": args.ratio, "kinds": {}}
    for kind, items in contexts(tokenizer, args.cases).items():
        rows = []
        for i, (ids, answers) in enumerate(items):
            captured = capture(engine, Context(request_id=f"{kind}-{i}", model=DEFAULT_MODEL, token_ids=ids))
            true = torch.stack([captured[layer][1] for layer in sorted(captured)])  # [L, H, c]
            predicted = torch.stack([surrogate(layer, captured[layer][0].unsqueeze(0))[0] for layer in sorted(captured)])
            row = measure(predicted, true, 1 - args.ratio)
            scored_from = len(ids) - true.shape[-1]  # the chat template's header is not scored
            for span in value_spans(tokenizer, ids, answers)[:1]:
                row |= answer_kept(predicted, true, 1 - args.ratio, [k - scored_from for k in span if k >= scored_from])
            rows.append(row)
        mean = {key: round(sum(r[key] for r in rows if key in r) / sum(key in r for r in rows), 3)
                for key in dict.fromkeys(k for r in rows for k in r)}
        result["kinds"][kind] = {"contexts": len(rows), "mean": mean}
        print(f"{kind:<11} " + "  ".join(f"{k} {v:.3f}" for k, v in mean.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
