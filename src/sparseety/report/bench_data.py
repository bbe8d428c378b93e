"""View data of a ``bench passkey``, ``bench ruler``, ``bench faithfulness`` or ``tune`` JSON file."""

from __future__ import annotations

from typing import Any

from sparseety.errors import RecordError


def bench_view(document: dict[str, Any]) -> dict[str, Any]:
    """The report view of a passkey or tune document (``document["kind"]`` says which)."""
    kind = document.get("kind")
    if kind == "passkey":
        return passkey_view(document)
    if kind == "tune":
        return tune_view(document)
    if kind == "ruler":
        return ruler_view(document)
    if kind == "faithfulness":
        return faithfulness_view(document)
    raise RecordError(f"unknown report source kind {kind!r}: expected 'passkey', 'ruler', 'faithfulness' or 'tune'")


def faithfulness_view(document: dict[str, Any]) -> dict[str, Any]:
    """The AOPC table (one row per method, best comprehensiveness first), both curves per method against
    the percentage of prompt tokens deleted (kept), and each prompt's top 5 tokens per ``--importance`` mode."""
    summary, fractions = document.get("summary"), document.get("fractions")
    if not isinstance(summary, dict) or not isinstance(fractions, list):
        raise RecordError("faithfulness JSON needs 'summary' (an object of methods) and 'fractions' (a list)")
    rows = []
    for method, row in summary.items():
        if not isinstance(row, dict) or not all(isinstance(row.get(k), list) and len(row[k]) == len(fractions)
                                                for k in ("comprehensiveness", "sufficiency")):
            raise RecordError(f"faithfulness JSON: summary[{method!r}] needs comprehensiveness and sufficiency "
                              f"lists of {len(fractions)} numbers")
        rows.append({"method": method, "aopc_comprehensiveness": row.get("aopc_comprehensiveness"),
                     "of_leave_one_out": row.get("of_leave_one_out"), "aopc_sufficiency": row.get("aopc_sufficiency"),
                     "comprehensiveness": row["comprehensiveness"], "sufficiency": row["sufficiency"]})
    rows.sort(key=lambda r: -(r["aopc_comprehensiveness"] or 0.0))
    results = document.get("results") if isinstance(document.get("results"), list) else []
    top5 = [{"title": str(r.get("title", r.get("case", "?"))), "answer": str(r.get("answer", "")),
             "tokens": {m: [str(t) for t in ts] for m, ts in (r.get("top5") or {}).items() if isinstance(ts, list)}}
            for r in results if isinstance(r, dict)]
    notes = [] if document.get("complete", True) else [f"Unfinished run: {len(results)} prompts so far."]
    return {
        "kind": "faithfulness",
        "title": "Faithfulness of the important-token rankings",
        "percents": [100 * float(f) for f in fractions],
        "table": rows,
        "top5": top5,
        "results": len(results),
        "extra": {k: v for k, v in document.items()
                  if k not in ("kind", "results", "summary", "complete") and not isinstance(v, (dict, list))},
        "notes": notes,
    }


def passkey_view(document: dict[str, Any]) -> dict[str, Any]:
    """Accuracy by policy x ratio and by policy x depth as dense grids (None where a cell was not run).

    Returns
    -------
    dict with ``accuracy`` and ``by_depth``, each ``{"rows": [policy], "columns": [label], "values":
    [[acc | None]]}`` with columns sorted numerically.
    """
    for key in ("accuracy", "by_depth"):
        if not isinstance(document.get(key, {}), dict):
            raise RecordError(f"passkey JSON key {key!r} must be an object of {{policy: {{value: accuracy}}}}")
    results = document.get("results") or []
    return {
        "kind": "passkey",
        "title": "Passkey retrieval",
        "accuracy": _grid(document.get("accuracy") or {}),
        "by_depth": _grid(document.get("by_depth") or {}),
        "results": len(results) if isinstance(results, list) else 0,
        "extra": {k: v for k, v in document.items()
                  if k not in ("kind", "results", "accuracy", "by_depth") and not isinstance(v, (dict, list))},
        "notes": [],
    }


def ruler_view(document: dict[str, Any]) -> dict[str, Any]:
    """Mean recall by policy x ratio over all tasks, one such grid per task, and the KV bytes held as a
    fraction of dense, as dense grids (None where a cell was not run)."""
    for key in ("accuracy", "by_task", "kv_bytes"):
        if not isinstance(document.get(key, {}), dict):
            raise RecordError(f"ruler JSON key {key!r} must be an object")
    kv = document.get("kv_bytes") or {}
    dense = next(iter((kv.get("dense") or {}).values()), None)
    kv_fraction = ({p: {r: v / dense for r, v in row.items() if isinstance(v, (int, float))}
                    for p, row in kv.items() if isinstance(row, dict)} if dense else {})
    results = document.get("results") or []
    return {
        "kind": "ruler",
        "title": "RULER-style tasks",
        "accuracy": _grid(document.get("accuracy") or {}),
        "tasks": [{"name": task, "grid": _grid(table)} for task, table in (document.get("by_task") or {}).items()
                  if isinstance(table, dict)],
        "kv_fraction": _grid(kv_fraction),
        "results": len(results) if isinstance(results, list) else 0,
        "extra": {k: v for k, v in document.items()
                  if k not in ("kind", "results", "accuracy") and not isinstance(v, (dict, list))},
        "notes": [],
    }


def tune_view(document: dict[str, Any]) -> dict[str, Any]:
    """The tuning curve sorted by budget, with the threshold and the answer."""
    curve = document.get("curve")
    if not isinstance(curve, list) or not all(isinstance(p, dict) and "budget" in p and "value" in p for p in curve):
        raise RecordError("tune JSON key 'curve' must be a list of {budget, ratio, value, meets} objects")
    points = sorted(curve, key=lambda p: float(p["budget"]))
    return {
        "kind": "tune",
        "title": f"Tuning {document.get('policy', '?')} on {document.get('metric', '?')}",
        "policy": document.get("policy"),
        "metric": document.get("metric"),
        "threshold": document.get("threshold"),
        "curve": [{"budget": p["budget"], "ratio": p.get("ratio"), "value": p["value"], "meets": bool(p.get("meets"))}
                  for p in points],
        "answer": document.get("answer") or {},
        "notes": [],
    }


def _grid(table: dict[str, Any]) -> dict[str, Any]:
    rows = list(table)
    columns = sorted({str(c) for cells in table.values() if isinstance(cells, dict) for c in cells}, key=_number)
    values = [[_cell(table[r], c) for c in columns] for r in rows]
    return {"rows": rows, "columns": columns, "values": values}


def _cell(cells: Any, column: str) -> float | None:
    if not isinstance(cells, dict):
        return None
    for key, value in cells.items():
        if str(key) == column and isinstance(value, (int, float)):
            return float(value)
    return None


def _number(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)
