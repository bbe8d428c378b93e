"""Render one self-contained HTML report: inline CSS and JS, data as one JSON ``<script>``, no network."""

from __future__ import annotations

import hashlib
import itertools
from functools import cache
from html import escape
from importlib.resources import files
from typing import Any

import numpy as np

from sparseety.report.data import trace_view
from sparseety.report.pack import pack, script_json, smallest_uint
from sparseety.report.timeline import NEVER
from sparseety.store import StoredTrace

_counter = itertools.count()


@cache
def _template(name: str) -> str:
    return files("sparseety.report").joinpath("templates", name).read_text(encoding="utf-8")


def render_html(trace: StoredTrace, *, layer: int | None = None) -> str:
    """The report of one stored run as a complete HTML document.

    Every style rule is scoped to the report's root element and the script finds that element by a
    unique id, so the same string also works embedded in a page (a notebook: :func:`sparseety.report.show`).
    """
    return render_view(trace_view(trace, layer=layer))


def render_view(view: dict[str, Any]) -> str:
    """Render a view from :mod:`sparseety.report.data` or :mod:`sparseety.report.bench_data`."""
    kind = view["kind"]
    root_id = "spx-" + hashlib.sha1(f"{view['title']}:{next(_counter)}".encode()).hexdigest()[:12]
    body = {"trace": _trace_body, "passkey": _passkey_body, "ruler": _ruler_body, "faithfulness": _faithfulness_body,
            "tune": _tune_body}[kind](view, root_id)
    notes = "".join(f'<div class="note">{escape(n)}</div>' for n in view.get("notes", []))
    script = f"(function(ROOT_ID){{\n{_template('report.js')}\n}})({script_json(root_id)});"
    replacements = [
        ("@@TITLE@@", escape(view["title"])),
        ("@@CSS@@", _template("report.css")),
        ("@@ROOT@@", root_id),
        ("@@KIND@@", kind),
        ("@@HEADING@@", escape(view["title"])),
        ("@@SUBTITLE@@", escape(_subtitle(view))),
        ("@@NOTES@@", notes),
        ("@@BODY@@", body),
        ("@@JS@@", script),
        ("@@DATA@@", script_json(payload(view))),  # last: its text is never scanned for markers
    ]
    out = _template("report.html")
    for marker, value in replacements:
        out = out.replace(marker, value, 1)
    return out


def payload(view: dict[str, Any]) -> dict[str, Any]:
    """The JSON object embedded in the page: the view, with large arrays packed as base64."""
    if view["kind"] != "trace":
        return view
    out = {k: v for k, v in view.items() if k not in ("importance", "ranks", "timeline", "summary", "provenance")}
    importance, ranks = view["importance"], view["ranks"]
    out["importance"] = None if importance is None else pack(importance.astype(np.float16))
    out["ranks"] = None if ranks is None else pack(ranks.astype(smallest_uint(int(ranks.max(initial=0)))))
    timeline = view["timeline"]
    if timeline is None:
        out["timeline"] = None
        return out
    dtype = smallest_uint(timeline.steps)  # steps 0 .. steps-1; the dtype's maximum marks "never"
    never = int(np.iinfo(dtype).max)

    def steps_of(a: np.ndarray) -> dict[str, Any]:
        return pack(np.where(a == NEVER, never, a).astype(dtype))

    out["timeline"] = {
        "never": never,
        "steps": timeline.steps,
        "kv_heads": timeline.kv_heads,
        "first_step": steps_of(timeline.first_step),
        "all_step": steps_of(timeline.all_step),
        "heads_evicted": pack(timeline.heads_evicted.astype(smallest_uint(timeline.kv_heads))),
        "kept_per_step": timeline.kept_per_step.round(2).tolist(),
        "kept_per_step_mean": timeline.kept_per_step.mean(axis=0).round(2).tolist()
        if len(timeline.kept_per_step) else [],
        "window_edge": None if timeline.window_edge is None
        else pack(timeline.window_edge.astype(smallest_uint(int(timeline.window_edge.max(initial=0))))),
    }
    return out


def _subtitle(view: dict[str, Any]) -> str:
    if view["kind"] == "trace":
        return f"request {view['request_id']}"
    if view["kind"] in ("passkey", "ruler"):
        return f"bench {view['kind']} · {view['results']} runs"
    if view["kind"] == "faithfulness":
        return f"bench faithfulness · {view['results']} prompts"
    return f"tune · policy {view.get('policy')} · metric {view.get('metric')}"


def _section(root_id: str, name: str, title: str, inner: str) -> str:
    return f'<section data-section="{name}" id="{root_id}-{name}"><h2>{escape(title)}</h2>{inner}</section>'


def _nav(root_id: str, sections: list[tuple[str, str]]) -> str:
    return "<nav>" + "".join(f'<a href="#{root_id}-{n}">{escape(t)}</a>' for n, t in sections) + "</nav>"


def _kv(rows: list[tuple[str, Any]]) -> str:
    return '<table class="kv">' + "".join(
        f"<tr><td>{escape(str(k))}</td><td>{escape('—' if v is None else str(v))}</td></tr>" for k, v in rows) + "</table>"


def _mark_legend(marks: dict[str, list[int]] | None) -> str:
    """Legend entries for the lifecycle marks the trace has (cached, recomputed, rejected drafts)."""
    from sparseety.report.data import MARKS

    return "".join(f'<span><span class="tok mark-{name}">abc</span> {escape(MARKS[name][1])} ({len(marks[name])})</span>'
                   for name in MARKS if marks and name in marks)


def _trace_body(view: dict[str, Any], root_id: str) -> str:
    sections: list[tuple[str, str, str]] = []
    cards = "".join(f'<div class="card"><h3>{escape(group)}</h3>{_kv(rows)}</div>' for group, rows in view["summary"])
    provenance = _kv([(k, v if not isinstance(v, dict) else ", ".join(f"{a}={b}" for a, b in v.items()))
                      for k, v in view["provenance"].items()])
    sections.append(("summary", "Summary", f'<div class="cards">{cards}</div>'
                     f'<details style="margin-top:10px"><summary class="muted">Provenance</summary>{provenance}</details>'))
    if view["positions"]:
        legend = ('<div class="legend"><span>importance 0 <span class="ramp"></span> 1 (<span class="imp-max"></span>)</span>'
                  '<span><i style="background:transparent;border-bottom:2px dotted var(--evicted)"></i>evicted by some KV heads</span>'
                  '<span><s style="text-decoration-color:var(--evicted)">abc</s> evicted by all KV heads</span>'
                  + _mark_legend(view.get("marks")) +
                  '<span>hover a token for its id, position, score, rank per layer and evictions</span></div>')
        sections.append(("text", "Text", legend + '<div class="label">Prompt</div><div class="text prompt"></div>'
                         '<div class="label">Output</div><div class="text output"></div>'))
    if view["timeline"] is not None:
        note = "" if view["evicts"] else '<div class="note">Nothing was evicted in this run.</div>'
        legend = ('<div class="legend">' + "".join(
            f'<span><i style="background:var(--{k})"></i>{label}</span>' for k, label in
            (("kept", "kept"), ("partly", "evicted by some KV heads"), ("evicted", "evicted by all KV heads"),
             ("unseen", "not yet seen")) + (("window", "outside the window (sliding layers)"),)
            * (view["timeline"].window_edge is not None)) + '<span>dashed line: end of the prompt · showing <b class="timeline-layer"></b></span></div>')
        sections.append(("timeline", "Eviction timeline", note + legend +
                         '<div class="row"><canvas class="timeline" aria-label="eviction timeline"></canvas>'
                         '<div class="kept-per-step"></div></div>'))
        sections.append(("layers", "Kept fraction per layer",
                         '<div class="sub">Share of the sequence each layer still held at the end (mean over KV heads). '
                         'Click a bar to select its layer.</div><div class="layers-chart"></div>'))
    if view["top"]:
        sections.append(("top-tokens", "Most important tokens",
                         '<div class="sub top-caption"></div><div class="scroll"><table class="data top"></table></div>'))
    if view["compare"]:
        sections.append(("compare", "Sparse against dense", '<div class="compare-body"></div>'))
    if view["window_frees"]:
        sections.append(("window-frees", "KV freed by sliding windows", '<div class="window-frees-body"></div>'))
    if view["moe"]:
        sections.append(("moe", "Expert load per layer", '<div class="moe-body"></div>'))
    if view["routing"]:
        sections.append(("routing", "Routing of the most important tokens", '<div class="routing-body"></div>'))
    if view["drafts"]:
        sections.append(("drafts", "Speculative drafts per step", '<div class="drafts-body"></div>'))
    if view["pruning"]:
        sections.append(("pruning", "Tokens per layer after pruning", '<div class="pruning-body"></div>'))
    options = '<option value="-1">all layers</option>' + "".join(
        f'<option value="{i}">layer {i}</option>' for i in range(view["layers"]))
    bar = (f'<div class="bar"><label>Layer <select class="layer-select" aria-label="layer">{options}</select></label>'
           f'{_nav(root_id, [(n, t) for n, t, _ in sections])}</div>')
    return bar + "".join(_section(root_id, *s) for s in sections)


def _passkey_body(view: dict[str, Any], root_id: str) -> str:
    extra = _kv(list(view["extra"].items())) if view["extra"] else ""
    return (extra + _section(root_id, "accuracy", "Accuracy by policy and compression ratio", '<div class="accuracy-body"></div>')
            + _section(root_id, "by-depth", "Accuracy by needle depth", '<div class="depth-body"></div>'))


def _ruler_body(view: dict[str, Any], root_id: str) -> str:
    extra = _kv(list(view["extra"].items())) if view["extra"] else ""
    tasks = "".join(_section(root_id, f"task-{i}", f"{t['name']}: recall by policy and ratio",
                             f'<div class="task-body-{i}"></div>') for i, t in enumerate(view["tasks"]))
    return (extra + _section(root_id, "accuracy", "Mean recall over all tasks by policy and ratio",
                             '<div class="accuracy-body"></div>')
            + tasks + _section(root_id, "kv", "KV held at the peak, fraction of dense", '<div class="kv-body"></div>'))


def _faithfulness_body(view: dict[str, Any], root_id: str) -> str:
    extra = _kv(list(view["extra"].items())) if view["extra"] else ""
    return (extra + _section(root_id, "aopc", "AOPC by ranking (higher comprehensiveness, lower sufficiency is better)",
                             '<div class="scroll"><table class="data aopc"></table></div>')
            + _section(root_id, "curves", "Drop of log p(answer) against the share of prompt tokens",
                       '<div class="comp-body"></div><div class="suff-body"></div>')
            + _section(root_id, "top5", "Top 5 tokens per prompt and mode", '<div class="top5-body"></div>'))


def _tune_body(view: dict[str, Any], root_id: str) -> str:
    return (_section(root_id, "tune", "Tuning curve", '<div class="tune-body"></div><div class="tune-table scroll"></div>')
            + _section(root_id, "answer", "Answer", '<div class="answer-body"></div>'))
