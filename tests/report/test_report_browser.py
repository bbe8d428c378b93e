"""The report in headless Chromium: no console error, no network request, sections, hover details,
layer selector, sortable table, bench pages, two reports on one page; a screenshot as a test artifact."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest

from sparseety.report import render_html, show, write_report
from sparseety.report.bench_data import bench_view
from sparseety.report.html import render_view
from sparseety.store import StoredTrace

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


class Page:
    """A page that records console errors, page errors and every request it makes."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)
        self.page.wait_for_selector(".spx[data-ready]", timeout=15000)

    def clean(self) -> None:
        assert self.errors == []
        assert self.requests == [self.url]


def open_report(browser, html: str, tmp_path: Path, name: str) -> Page:
    path = tmp_path / name
    path.write_text(html, encoding="utf-8")
    return Page(browser, path)


def test_real_report(browser, real_trace, tmp_path: Path):
    path = write_report(real_trace, tmp_path / "report.html")
    page = Page(browser, path)
    p = page.page
    for name in ("summary", "text", "timeline", "layers", "top-tokens"):
        assert p.locator(f'section[data-section="{name}"]').count() == 1
    doc = real_trace.document
    n = len(doc["prompt_token_ids"]) + len(doc["output_token_ids"])
    assert p.locator(".text .tok").count() == n
    assert p.locator(".text.prompt .tok").count() == len(doc["prompt_token_ids"])
    # a token that H2O evicted in some layer: the tooltip names its id, position, score, rank and the eviction
    a = real_trace.arrays
    position = int(a["evicted.position"][0])
    step, layer = int(a["evicted.step"][0]), int(a["evicted.layer"][0])
    token = p.locator(f'.tok[data-p="{position}"]')
    assert token.inner_text() == doc["token_texts"][position]
    token.hover()
    tip = p.locator(".tip")
    assert tip.is_visible()
    text = tip.inner_text()
    ids = doc["prompt_token_ids"] + doc["output_token_ids"]
    assert f"id {ids[position]} · position {position}" in text
    assert "score (all layers):" in text and "rank per layer:" in text and "L29 #" in text
    assert "evicted in " in text and f"step {step}" in text
    ARTIFACTS.mkdir(exist_ok=True)
    p.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    # the layer selector changes the shading, the timeline and the table
    before_bg = token.evaluate("e => e.style.backgroundColor")
    before_canvas = p.locator("canvas.timeline").evaluate("c => c.toDataURL()")
    p.locator("select.layer-select").select_option(str(layer))
    assert p.locator(".timeline-layer").inner_text() == f"layer {layer}"
    assert p.locator("canvas.timeline").evaluate("c => c.toDataURL()") != before_canvas
    score = float(a["importance"][layer, position])
    all_score = float(a["importance"][:, position].astype(np.float32).sum())
    if not np.isclose(score / a["importance"][layer].astype(np.float32).max(),
                      all_score / a["importance"].astype(np.float32).sum(0).max()):
        assert token.evaluate("e => e.style.backgroundColor") != before_bg
    p.locator("h1").hover()
    token.hover()
    assert f"score (layer {layer}):" in tip.inner_text()
    top = [r for r in doc["important_tokens"] if r["layer"] == layer]
    assert p.locator("table.top tbody tr").count() == len(top)
    # sorting by position puts the positions in order, a second click reverses it
    header = p.locator('table.top th[data-key="position"]')
    header.click()
    shown = [int(x) for x in p.locator("table.top tbody tr td:nth-child(2)").all_inner_texts()]
    assert shown == sorted(r["position"] for r in top)
    p.locator('table.top th[data-key="position"]').click()
    assert p.locator('table.top th[data-key="position"]').get_attribute("aria-sort") == "descending"
    page.clean()


def test_compare_moe_drafts_and_pruning_sections(browser, moe_trace, tmp_path: Path):
    document = copy.deepcopy(moe_trace.document)
    document["compare"] = {
        "baseline_request_id": "base123",
        "diff": {"ratio": 0.8, "first_divergence": 2, "ops": [
            {"tag": "equal", "baseline_tokens": ["The", " sky"], "sparse_tokens": ["The", " sky"]},
            {"tag": "replace", "baseline_tokens": [" is"], "sparse_tokens": [" <b>was</b>"]},
            {"tag": "insert", "baseline_tokens": [], "sparse_tokens": [" very"]}]},
        "fidelity": {"kl_mean": 0.1, "kl_per_step": [0.0, 0.05, 0.2, None, 0.1]},
        "quality": {"rouge_l": 0.7},
    }
    arrays = dict(moe_trace.arrays)
    arrays.update({"pruned.step": np.array([0, 0]), "pruned.layer": np.array([0, 1]),
                   "pruned.kv_head": np.array([-1, -1]), "pruned.position": np.array([3, 4])})
    trace = StoredTrace(document=document, arrays=arrays, path=moe_trace.path)
    page = open_report(browser, render_html(trace), tmp_path, "moe.html")
    p = page.page
    for name in ("compare", "moe", "drafts", "pruning"):
        assert p.locator(f'section[data-section="{name}"] svg').count() >= 1, name
    assert p.locator(".diff .ins").first.inner_text() == " <b>was</b>"
    assert p.locator(".diff .del").first.inner_text() == " is"
    assert p.locator('section[data-section="compare"] svg path').count() == 1  # the KL line
    assert p.locator('section[data-section="moe"] svg rect').count() == 3 * 4  # layers x experts
    page.clean()


def test_passkey_and_tune_pages(browser, tmp_path: Path):
    passkey = render_view(bench_view({"kind": "passkey", "results": [],
                                      "accuracy": {"h2o": {"0.5": 0.5, "0.75": 0.25}, "dense": {"0.5": 1.0}},
                                      "by_depth": {"h2o": {"0.1": 1.0, "0.5": 0.5}, "dense": {"0.1": 1.0}}}))
    page = open_report(browser, passkey, tmp_path, "passkey.html")
    cells = page.page.locator('section[data-section="accuracy"] td').all_inner_texts()
    assert cells == ["50%", "25%", "100%", "—"]
    assert page.page.locator('section[data-section="by-depth"] svg path').count() == 2
    page.clean()
    tune = render_view(bench_view({"kind": "tune", "policy": "h2o", "metric": "rouge_l", "threshold": 0.8,
                                   "curve": [{"budget": 8, "ratio": 0.9, "value": 0.3, "meets": False},
                                             {"budget": 32, "ratio": 0.5, "value": 0.9, "meets": True}],
                                   "answer": {"budget": 32}}))
    page = open_report(browser, tune, tmp_path, "tune.html")
    assert page.page.locator('section[data-section="tune"] svg circle').count() == 2
    assert "32" in page.page.locator('section[data-section="answer"]').inner_text()
    page.clean()


def test_two_reports_embedded_in_one_page(browser, real_trace, tmp_path: Path):
    """What a notebook does with ``show(trace)``'s ``_repr_html_``: both reports draw, each in its own root."""
    html = "<html><body><div>" + show(real_trace)._repr_html_() + "</div><div>" + render_html(real_trace, layer=2) + \
        "</div></body></html>"
    page = open_report(browser, html, tmp_path, "two.html")
    roots = page.page.locator(".spx[data-ready]")
    assert roots.count() == 2
    assert roots.nth(0).locator(".timeline-layer").inner_text() == "all layers"
    assert roots.nth(1).locator(".timeline-layer").inner_text() == "layer 2"
    page.clean()


def test_tier1_ids_only_trace_draws_without_scores(browser, real_trace, tmp_path: Path):
    """No importance, no final cache, no token texts: the page still draws and says what is missing."""
    document = copy.deepcopy(real_trace.document)
    document.update(tier=1, token_texts=[], important_tokens=[], ids_only=True)  # as the reader sets it
    document["sparsity"]["kept_positions_final"] = None
    arrays = {k: v for k, v in real_trace.arrays.items() if k.startswith("evicted.")}
    trace = StoredTrace(document=document, arrays=arrays, path=real_trace.path)
    page = open_report(browser, render_html(trace), tmp_path, "tier1.html")
    p = page.page
    notes = p.locator(".note").all_inner_texts()
    assert any("no importance scores" in n for n in notes) and any("ids-only" in n for n in notes)
    first_id = document["prompt_token_ids"][0]
    assert p.locator('.tok[data-p="0"]').inner_text() == f"⟨{first_id}⟩"
    assert p.locator('section[data-section="top-tokens"]').count() == 0
    assert p.locator('section[data-section="timeline"] canvas').count() == 1
    p.locator(f'.tok[data-p="{int(arrays["evicted.position"][0])}"]').hover()
    assert "score" not in p.locator(".tip").inner_text() and "evicted in" in p.locator(".tip").inner_text()
    page.clean()
