"""``sparseety report`` on a ``bench faithfulness`` result: the AOPC table, both curves, the top-5 tokens,
in headless Chromium (no console error, no network request), and the PNG figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.errors import RecordError
from sparseety.report.bench_data import bench_view

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]

DOCUMENT = {
    "kind": "faithfulness", "model": "tiny", "fractions": [0.01, 0.05, 0.1, 0.2], "complete": True,
    "methods": ["value", "random", "leave_one_out"],
    "summary": {
        "value": {"comprehensiveness": [1.0, 2.0, 3.0, 4.0], "sufficiency": [4.0, 3.0, 2.0, 1.0],
                  "aopc_comprehensiveness": 2.5, "aopc_sufficiency": 2.5, "of_leave_one_out": 0.5},
        "random": {"comprehensiveness": [0.0, 0.5, 0.5, 1.0], "sufficiency": [5.0, 5.0, 5.0, 5.0],
                   "aopc_comprehensiveness": 0.5, "aopc_sufficiency": 5.0, "of_leave_one_out": 0.1},
        "leave_one_out": {"comprehensiveness": [3.0, 5.0, 6.0, 6.0], "sufficiency": [4.0, 2.0, 1.0, 0.0],
                          "aopc_comprehensiveness": 5.0, "aopc_sufficiency": 1.75, "of_leave_one_out": 1.0},
    },
    "results": [{"case": 0, "title": "GPL-3", "prompt_tokens": 30, "answer": " a licence", "comprehensiveness": {},
                 "sufficiency": {}, "top5": {"value": [" Free", " <b>", "\n", " GNU", " the"]}}],
}


def test_view_orders_the_table_and_keeps_the_top5():
    view = bench_view(DOCUMENT)
    assert [r["method"] for r in view["table"]] == ["leave_one_out", "value", "random"]
    assert view["percents"] == [1.0, 5.0, 10.0, 20.0]
    assert view["top5"] == [{"title": "GPL-3", "answer": " a licence",
                             "tokens": {"value": [" Free", " <b>", "\n", " GNU", " the"]}}]
    with pytest.raises(RecordError, match=r"summary\['value'\] needs comprehensiveness and sufficiency lists of 4"):
        bench_view({**DOCUMENT, "summary": {"value": {"comprehensiveness": [1.0], "sufficiency": [1.0]}}})


def test_report_command_writes_the_page_and_pngs(tmp_path: Path):
    source = tmp_path / "faithfulness.json"
    source.write_text(json.dumps(DOCUMENT))
    out = tmp_path / "page.html"
    result = CliRunner().invoke(app, ["report", str(source), "-o", str(out), "--png", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert "bench faithfulness · 1 prompts" in html and "Top 5 tokens per prompt and mode" in html
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["faithfulness_comprehensiveness.png",
                                                                     "faithfulness_sufficiency.png"]


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_page_in_headless_chromium(tmp_path: Path):
    from playwright.sync_api import sync_playwright

    from sparseety.report.html import render_view

    path = tmp_path / "f.html"
    path.write_text(render_view(bench_view(DOCUMENT)), encoding="utf-8")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        requests: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.resolve().as_uri())
        page.wait_for_selector(".spx[data-ready]", timeout=15000)
        rows = page.locator("table.aopc tr").all_inner_texts()
        assert [r.split("\t") for r in rows[1:]] == [["leave_one_out", "5.00", "1.00", "1.75"],
                                                     ["value", "2.50", "0.50", "2.50"],
                                                     ["random", "0.50", "0.10", "5.00"]]
        assert page.locator('section[data-section="curves"] svg path').count() == 2 * 3
        cells = page.locator("table.top5 td").all_inner_texts()
        assert cells == ["value", '" Free"', '" <b>"', '"\\n"', '" GNU"', '" the"']  # text, never markup
        assert errors == [] and requests == [path.resolve().as_uri()]
        browser.close()
