"""``value_aware`` (VATP) eviction against the plain policies on ``bench passkey`` and ``bench ruler`` cases.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.studies.value_aware_bench [--policies h2o,tova,snapkv] [--ratio 0.5]
        [--lengths 1000] [--depths 0.1,0.5,0.9] [--tasks niah_single,niah_multikey,niah_multivalue,vt,cwe]
        [--ruler-cases 1] [--seed 0] [--threads 1] [--out benchmarks/results/studies/value_aware.json] [--resume]

The cases, encoding, protocol and scoring are ``sparseety bench passkey``'s and ``sparseety bench ruler``'s
(:func:`sparseety.suites.passkey_run.answer_case`, :func:`sparseety.suites.ruler_run.answer_ruler_case`):
the context compressed by the policy at ``--ratio``, the question fed uncompressed, a greedy answer. One
process and one model load answer every case under dense, then each policy plain and with
``value_aware=true`` (the two variants of a policy interleaved case by case, so load on this shared
machine falls on both alike). The CLI cannot run one policy twice with different options in one run,
hence this script. The JSON is rewritten after every answer (``"complete": false`` until the end) and
records the command; ``--resume`` keeps the answers of an unfinished file with the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import command

RESULTS = Path(__file__).resolve().parents[1] / "results" / "studies" / "value_aware.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="h2o,tova,snapkv")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--lengths", default="1000")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--tasks", default="niah_single,niah_multikey,niah_multivalue,vt,cwe")
    p.add_argument("--ruler-cases", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--resume", action="store_true")
    return p.parse_args(argv)


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def tables(rows: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Mean passkey accuracy, RULER score per task and overall, per variant (a policy name, ``+va`` = value-aware)."""
    out: dict[str, Any] = {"passkey": {}, "ruler": {}, "ruler_by_task": {}}
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        out["passkey"][v] = mean([float(r["correct"]) for r in mine if r["bench"] == "passkey"])
        ruler = [r for r in mine if r["bench"] == "ruler"]
        out["ruler"][v] = mean([r["score"] for r in ruler])
        out["ruler_by_task"][v] = {t: mean([r["score"] for r in ruler if r["task"] == t])
                                   for t in dict.fromkeys(r["task"] for r in ruler)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from sparseety.suites.passkey import make_cases, tokenizer_counter
    from sparseety.suites.passkey_run import answer_case
    from sparseety.suites.ruler import make_ruler_cases
    from sparseety.suites.ruler_run import answer_ruler_case
    from sparseety.engine import SparseEngine
    from sparseety.models import load_model

    torch.set_num_threads(args.threads)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "resume"}
    run_command = command(argv)
    rows: list[dict[str, Any]] = []
    if args.resume and args.out.exists():
        before = json.loads(args.out.read_text())
        if before.get("settings") != settings:
            raise SystemExit(f"error: {args.out} was run with other settings: {before.get('settings')}")
        rows = before["rows"]
    done = {(r["bench"], r["variant"], r["case"]) for r in rows}

    lm, tokenizer = load_model(args.model)
    engine = SparseEngine(lm, tokenizer, args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    passkey = make_cases(lengths, [float(x) for x in args.depths.split(",")], seed=args.seed,
                         count_tokens=tokenizer_counter(tokenizer))
    ruler = make_ruler_cases(args.tasks.split(","), lengths, args.ruler_cases, seed=args.seed,
                             count_tokens=tokenizer_counter(tokenizer))
    variants = ["dense"] + [v for p in policies for v in (p, f"{p}+va")]
    cases = [("passkey", f"{c.length}@{c.depth}", c) for c in passkey] + \
            [("ruler", f"{c.task}/{c.length}/{c.index}", c) for c in ruler]

    def describe(variant: str) -> str:
        if variant == "dense":
            return "dense"
        extra = " value_aware=true" if variant.endswith("+va") else ""
        return f"{variant.removesuffix('+va')} ratio {args.ratio}{extra}"

    def save(complete: bool) -> None:
        doc = {"kind": "value_aware", "command": run_command, "settings": settings,
               "model": args.model, "threads": args.threads, "cases": {"passkey": len(passkey), "ruler": len(ruler)},
               "variants": {v: describe(v) for v in variants},
               **tables(rows, variants), "rows": rows, "complete": complete}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.out)

    start = time.perf_counter()
    plan = [("dense", case) for case in cases] + [(v, case) for p in policies for case in cases
                                                  for v in (p, f"{p}+va")]
    for i, (variant, (bench, label, case)) in enumerate(plan, 1):
        if (bench, variant, label) in done:
            continue
        name = variant.removesuffix("+va")
        ratio = 0.0 if name == "dense" else args.ratio
        options = {"value_aware": "true"} if variant.endswith("+va") else None
        answer = (answer_case if bench == "passkey" else answer_ruler_case)(
            engine, case, name, ratio, options=options, seed=args.seed)
        row = {"bench": bench, "variant": variant, "case": label, **asdict(answer)}
        if bench == "ruler":
            row.pop("expected", None)
        rows.append(row)
        save(False)
        got = row.get("correct", row.get("score"))
        print(f"[{i}/{len(plan)}] {variant} {bench} {label}: {got} ({answer.seconds:.1f} s, "
              f"{time.perf_counter() - start:.0f} s total)", file=sys.stderr, flush=True)
    save(True)
    t = tables(rows, variants)
    print(f"{'variant':<14} {'passkey':>8} {'ruler':>8}")
    for v in variants:
        print(f"{v:<14} {t['passkey'][v]!s:>8} {t['ruler'][v]!s:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
