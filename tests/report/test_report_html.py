"""The HTML file: self-contained, escaped, fragment-safe, data round trips, size bound on a large trace."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from importlib.resources import files

import numpy as np
import pytest

from sparseety.report import render_html, render_view
from sparseety.report.bench_data import bench_view
from sparseety.report.data import trace_view
from sparseety.report.html import payload
from sparseety.report.pack import pack, script_json, unpack
from sparseety.report.synthetic import synthetic_trace


class Refs(HTMLParser):
    """Every tag and attribute that could load something, and every script's type and body."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[str, str, str]] = []
        self.scripts: list[dict[str, str | None]] = []
        self.styles: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "srcset", "data", "poster") or (name == "href" and tag != "a"):
                self.loads.append((tag, name, value or ""))
            if name == "href" and tag == "a" and not (value or "").startswith("#"):
                self.loads.append((tag, name, value or ""))
        if tag == "script":
            self.scripts.append({"type": dict(attrs).get("type"), "body": ""})
        self._in = tag if tag in ("script", "style") else None

    def handle_data(self, data):
        if self._in == "script":
            self.scripts[-1]["body"] += data
        elif self._in == "style":
            self.styles.append(data)

    def handle_endtag(self, tag):
        self._in = None


def parse(html: str) -> Refs:
    refs = Refs()
    refs.feed(html)
    return refs


def embedded(html: str) -> dict:
    data = [s for s in parse(html).scripts if s["type"] == "application/json"]
    assert len(data) == 1
    return json.loads(data[0]["body"])


def test_no_external_scripts_styles_or_fonts(real_trace):
    html = render_html(real_trace)
    refs = parse(html)
    assert refs.loads == []
    css = "".join(refs.styles)
    assert "@import" not in css and "url(" not in css and "@font-face" not in css
    assert [s["type"] for s in refs.scripts] == ["application/json", None]
    assert "<link" not in html and "<iframe" not in html
    # the only URL anywhere is the SVG namespace name, which loads nothing
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) <= {"http://www.w3.org/2000/svg"}


def test_token_text_is_escaped_and_survives_as_data(real_trace):
    texts = real_trace.document["token_texts"]
    assert any("script" in t for t in texts) and any("<" in t for t in texts)
    html = render_html(real_trace)
    assert html.count("<script") == 2 and html.count("</script>") == 2
    data = embedded(html)
    assert data["tokens"]["text"] == texts
    assert data["tokens"]["ids"] == real_trace.document["prompt_token_ids"] + real_trace.document["output_token_ids"]


def test_script_json_cannot_close_its_tag():
    text = script_json({"t": "</script><script>alert(1)</script>", "u": "\u2028&", "nan": float("nan")})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"t": "</script><script>alert(1)</script>", "u": "\u2028&", "nan": None}


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.float16, np.float32])
def test_pack_round_trip(dtype):
    array = (np.arange(24).reshape(4, 6) * 3).astype(dtype)
    np.testing.assert_array_equal(unpack(pack(array)), array)


def test_embedded_arrays_round_trip(real_trace):
    view = trace_view(real_trace)
    data = embedded(render_view(view))
    np.testing.assert_array_equal(unpack(data["importance"]), view["importance"])
    np.testing.assert_array_equal(unpack(data["ranks"]), view["ranks"])
    timeline, never = view["timeline"], data["timeline"]["never"]
    first = unpack(data["timeline"]["first_step"]).astype(np.int64)
    np.testing.assert_array_equal(np.where(first == never, -1, first), timeline.first_step)
    assert data["timeline"]["steps"] == timeline.steps == len(real_trace.document["output_token_ids"])


def test_css_is_scoped_to_the_report_root():
    css = files("sparseety.report").joinpath("templates", "report.css").read_text()
    for block in re.findall(r"([^{}]+)\{", re.sub(r"/\*.*?\*/", "", css, flags=re.S)):
        for selector in block.split(","):
            assert selector.strip().startswith(".spx"), selector


def test_two_reports_get_distinct_roots(real_trace):
    ids = [re.search(r'class="spx" id="([^"]+)"', render_html(real_trace)).group(1) for _ in range(2)]
    assert ids[0] != ids[1]


def test_sections_follow_what_the_trace_holds(real_trace, moe_trace):
    html = render_html(real_trace)
    for name in ("summary", "text", "timeline", "layers", "top-tokens"):
        assert f'data-section="{name}"' in html
    for name in ("compare", "moe", "drafts", "pruning"):
        assert f'data-section="{name}"' not in html
    moe = render_html(moe_trace)
    assert 'data-section="moe"' in moe and 'data-section="drafts"' in moe


def test_large_trace_stays_under_5_mb_and_says_it_aggregates():
    trace = synthetic_trace()
    assert len(trace.document["token_texts"]) == 8192 and trace.arrays["importance"].shape == (30, 8191)
    assert trace.arrays["step_importance"].shape == (64, 30, 8191)
    html = render_html(trace)
    assert len(html.encode()) < 5 * 2**20
    assert "8,192 positions: the timeline aggregates them into bins of 5 positions" in html
    data = embedded(html)
    assert data["timeline"]["steps"] == 64 and data["positions"] == 8192


def test_bench_pages_carry_their_sections():
    passkey = render_view(bench_view({"kind": "passkey", "results": [], "accuracy": {"h2o": {"0.5": 1.0}},
                                      "by_depth": {"h2o": {"0.5": 1.0}}}))
    assert 'data-section="accuracy"' in passkey and 'data-section="by-depth"' in passkey
    tune = render_view(bench_view({"kind": "tune", "policy": "h2o", "metric": "kl", "threshold": 0.1,
                                   "curve": [{"budget": 8, "value": 0.3, "meets": False}], "answer": {}}))
    assert 'data-section="tune"' in tune and embedded(tune)["curve"][0]["budget"] == 8


def test_payload_leaves_summary_to_the_static_page(real_trace):
    view = trace_view(real_trace)
    data = payload(view)
    assert "summary" not in data and "provenance" not in data
    html = render_view(view)
    assert f"<td>{real_trace.request_id}</td>" in html and "transformers_version" in html


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_written_report_gets_the_permissions_of_any_new_file(tmp_path, umask):
    """A report is written atomically but not owner-only: the user's umask decides, as for any new file."""
    import os

    from sparseety.report.write import write_html

    before = os.umask(umask)
    try:
        write_html(tmp_path / "r.html", "<!DOCTYPE html>")
    finally:
        os.umask(before)
    assert (tmp_path / "r.html").stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]  # no temporary file left behind
