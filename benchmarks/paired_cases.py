"""Two policies on the same cases, case by case: where they differ, and whether the difference is more than chance.

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.paired_cases RESULT_JSON [RESULT_JSON ...] --a sparseety:kvzap --b sparseety:kvzip
        [--ratio 0.5] [--tasks passkey,niah_multikey] [--alias [FILE_NAME:]OLD=NEW ...] [--out FILE]

Reads ``benchmarks/kvpress_compare.py`` result files (rows of several files merged as its ``--markdown`` does).
``--a``/``--b`` name ``SIDE:POLICY`` (side ``sparseety`` or ``kvpress``). Per task, over the cases both ran at the
ratio: each one's total score, the cases where A scored higher and where B did, and the exact two-sided sign
test (McNemar's exact test for pass/fail scores) on those discordant cases: the chance of a split at least as
uneven if neither policy were better. A one-case gap on 18 cases is a split such as 2 against 1 (p = 1.0).
``--alias OLD=NEW`` reads SparSEEty's policy ``OLD`` as ``NEW`` (a press's name never changed meaning); ``--alias FILE_NAME:OLD=NEW`` does so in the files of that
name only. Files written before ``per_head=true`` became ``kvzap``'s default (2026-12-03) name it
``kvzap_per_head``, and their ``kvzap`` rows are today's ``kvzap_uniform``. A case run under one name by two files
counts once, the later file's row.
"""

from __future__ import annotations

import argparse
import json
from math import comb
from pathlib import Path

from benchmarks.common import command
from benchmarks.kvpress_compare import CASE_KEYS, merged_rows

SIDES = ("sparseety", "kvpress")


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test: the chance, under a fair coin, of a split of ``wins + losses`` discordant
    cases at least as uneven as the one seen (1.0 when there is none)."""
    n, low = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(comb(n, k) for k in range(low + 1)) / 2**n)


def paired(a: dict[tuple, float], b: dict[tuple, float]) -> dict:
    """The comparison over the cases in both ``a`` and ``b`` (``{case key: score}``)."""
    shared = sorted(a.keys() & b.keys(), key=str)
    wins = sum(a[k] > b[k] for k in shared)
    losses = sum(a[k] < b[k] for k in shared)
    total_a, total_b = sum(a[k] for k in shared), sum(b[k] for k in shared)
    return {"cases": len(shared), "score_a": round(total_a, 4), "score_b": round(total_b, 4),
            "a_over_b": round(total_a / total_b, 4) if total_b else None,
            "a_better": wins, "b_better": losses, "sign_test_p": float(f"{sign_test(wins, losses):.4g}")}


def read(files: list[Path], aliases: list[str]) -> dict[str, list[dict]]:
    """Each side's rows of ``files``, SparSEEty's policies renamed by ``aliases`` (``[FILE_NAME:]OLD=NEW``)."""
    renames: list[tuple[str, str, str]] = []
    for alias in aliases:
        scope, _, pair = alias.rpartition(":")
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise SystemExit(f"paired_cases: --alias takes [FILE_NAME:]OLD=NEW, got {alias!r}")
        renames.append((scope, old, new))
    rows: dict[str, list[dict]] = {side: [] for side in SIDES}
    for path in files:
        names = {old: new for scope, old, new in renames if scope in ("", path.name)}
        ours, theirs = merged_rows([path])
        rows["sparseety"] += [r | {"policy": names.get(r["policy"], r["policy"])} for r in ours]
        rows["kvpress"] += theirs
    return rows


def scores(rows: list[dict], policy: str, ratio: float, task: str) -> dict[tuple, float]:
    """``{case key: score}`` of ``policy`` on ``task`` (dense at ratio 0); a later row of a case wins."""
    want = 0.0 if policy == "dense" else ratio
    return {tuple(r.get(k) for k in CASE_KEYS): float(r["score"]) for r in rows
            if r["policy"] == policy and r["task"] == task and r["ratio"] == want}


def parse_side(text: str) -> tuple[str, str]:
    side, _, policy = text.partition(":")
    if side not in SIDES or not policy:
        raise SystemExit(f"paired_cases: name a policy as SIDE:POLICY with SIDE one of {', '.join(SIDES)}, got {text!r}")
    return side, policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+", metavar="RESULT_JSON")
    parser.add_argument("--a", required=True, help="SIDE:POLICY, e.g. sparseety:kvzap")
    parser.add_argument("--b", required=True, help="SIDE:POLICY, e.g. kvpress:kvzap")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--tasks", default="", help="comma-separated (default: every task in the files)")
    parser.add_argument("--alias", action="append", default=[], metavar="[FILE_NAME:]OLD=NEW")
    parser.add_argument("--out", type=Path, default=None, help="also write the result here as JSON")
    args = parser.parse_args()
    rows = read(args.files, args.alias)
    (side_a, policy_a), (side_b, policy_b) = parse_side(args.a), parse_side(args.b)
    tasks = args.tasks.split(",") if args.tasks else list(dict.fromkeys(r["task"] for r in rows["sparseety"]))
    result: dict[str, object] = {"command": command(), "a": args.a, "b": args.b,
                                 "ratio": args.ratio, "tasks": {}}
    for task in tasks:
        got = paired(scores(rows[side_a], policy_a, args.ratio, task), scores(rows[side_b], policy_b, args.ratio, task))
        if not got["cases"]:
            print(f"{task:<16} no case ran under both {args.a} and {args.b} at ratio {args.ratio}")
            continue
        result["tasks"][task] = got
        print(f"{task:<16} {got['cases']:>3} cases | A {got['score_a']:>6g}  B {got['score_b']:>6g}  "
              f"A/B {got['a_over_b'] if got['a_over_b'] is not None else '-'} | A better {got['a_better']}, "
              f"B better {got['b_better']} | sign test p = {got['sign_test_p']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
