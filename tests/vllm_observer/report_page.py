"""Open the report of one stored vLLM request in headless Chromium (rendered by ``sparseety report``, the
command users run), with page errors and network requests recorded; a screenshot in ``test-artifacts/``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from vllm_server import ROOT

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"


@contextmanager
def report_page(trace_dir: Path, request_id: str, out: Path) -> Iterator:
    """Yield the Playwright page of ``request_id``'s report; on exit, assert it raised no error and
    fetched nothing but itself, and save a full-page screenshot named after ``out``."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed")
    from playwright.sync_api import sync_playwright

    cli = str(Path(sys.executable).with_name("sparseety"))
    subprocess.run([cli, "report", str(trace_dir), "--request-id", request_id, "-o", str(out)],
                   capture_output=True, text=True, check=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            requests: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("request", lambda r: requests.append(r.url))
            url = out.resolve().as_uri()
            page.goto(url)
            page.wait_for_selector(".spx[data-ready]", timeout=15000)
            yield page
            assert errors == [] and requests == [url], (errors, requests)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{out.stem}.png"), full_page=True)
        finally:
            browser.close()
