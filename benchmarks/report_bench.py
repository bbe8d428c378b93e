"""Report benchmark: an 8k-token, 64-step, 30-layer tier-3 trace rendered to HTML and opened in headless Chromium.

Figures, all from one run:

- ``html_bytes``: the report file size (target < 5 MB);
- ``render_s``: ``render_html`` in Python (median of 3);
- ``browser_ready_ms``: from navigation start until the page has drawn everything (text, timeline of
  all layers, charts, table), read from ``performance.now()`` when the script finishes (median of 3
  fresh page loads; target < 2000 ms);
- ``layer_switch_ms``: selecting one layer (shading, timeline, charts, table redrawn), median of 5;
- ``all_layers_ms``: going back to "all layers" (the most work: every layer's timeline), median of 3;
- ``ready_vs_target``: ``browser_ready_ms / 2000`` (below 1 meets the target).

The trace is :func:`sparseety.report.synthetic.synthetic_trace` (H2O-shaped evictions, budget 1024).

Usage::

    .venv/bin/python -m benchmarks.report_bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import command, machine, source
from sparseety.report import render_html
from sparseety.report.synthetic import synthetic_trace

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
RESULTS = Path(__file__).parent / "results" / "report" / "report.json"
TARGET_MS = 2000.0


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options; --help says what it is
    from playwright.sync_api import sync_playwright

    trace = synthetic_trace()
    renders = []
    for _ in range(3):
        start = time.perf_counter()
        html = render_html(trace)
        renders.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.html"
        path.write_text(html, encoding="utf-8")
        ready, switch, back = [], [], []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            for _ in range(3):
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(path.as_uri())
                page.wait_for_selector(".spx[data-ready]", timeout=60000)
                if errors:
                    raise SystemExit(f"page errors: {errors}")
                ready.append(float(page.locator(".spx").get_attribute("data-ready-ms")))
                for layer in (3, 11, 17, 24, 29):
                    switch.append(select(page, str(layer)))
                back.append(select(page, "-1"))
                page.close()
            browser.close()
    figures = {
        "positions": 8192, "steps": 64, "layers": 30,
        "html_bytes": len(html.encode()),
        "html_mb": round(len(html.encode()) / 2**20, 3),
        "render_s": round(statistics.median(renders), 3),
        "browser_ready_ms": round(statistics.median(ready), 1),
        "layer_switch_ms": round(statistics.median(switch), 1),
        "all_layers_ms": round(statistics.median(back), 1),
        "ready_vs_target": round(statistics.median(ready) / TARGET_MS, 3),
        "meets_size_target": len(html.encode()) < 5 * 2**20,
        "meets_ready_target": statistics.median(ready) < TARGET_MS,
        "command": command(), "source": source(), "machine": machine(),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=1) + "\n")
    for key, value in figures.items():
        print(f"{key:>20}: {value}")
    print(f"saved {RESULTS}")


def select(page, value: str) -> float:
    """Milliseconds the page spends redrawing after the layer selector changes to ``value``."""
    return page.evaluate(
        """(value) => { const s = document.querySelector("select.layer-select"); const t = performance.now();
        s.value = value; s.dispatchEvent(new Event("change")); return performance.now() - t; }""", value)


if __name__ == "__main__":
    main()
