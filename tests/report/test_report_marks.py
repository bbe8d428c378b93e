"""The text view marks the token lifecycle a serving engine reports: prefix-cache hits, tokens recomputed
after a preemption, positions where a speculative draft was rejected (as vLLM traces and own-engine ``--speculative`` runs carry them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_report_browser import browser, open_report  # noqa: F401  (the module-scoped browser fixture)

from sparseety.report import render_html
from sparseety.report.data import token_marks
from sparseety.store import StoredTrace


def test_marks_come_from_the_lifecycle_arrays():
    arrays = {"cached.position": np.array([0, 1, 2, 2]), "recomputed.position": np.array([5, 99]),
              "drafted.position": np.array([6, 7, -1]), "drafted.rejected": np.array([0, 1, 1])}
    assert token_marks(arrays, positions=10) == {"cached": [0, 1, 2], "recomputed": [5], "rejected": [7]}
    # draft positions -1 (a vLLM trace recorded without its drafts hook) mark nothing; no lifecycle arrays, no marks
    assert token_marks({"drafted.position": np.array([-1, -1]), "drafted.rejected": np.array([1, 1])}, 10) is None
    assert token_marks({}, 10) is None


def test_marked_tokens_are_drawn_and_explained_on_hover(browser, real_trace, tmp_path: Path):
    arrays = dict(real_trace.arrays)
    arrays.update({"cached.position": np.array([0, 1, 2, 3]), "recomputed.position": np.array([5]),
                   "drafted.position": np.array([6, 7]), "drafted.rejected": np.array([0, 1])})
    trace = StoredTrace(document=real_trace.document, arrays=arrays, path=real_trace.path)
    page = open_report(browser, render_html(trace), tmp_path, "marks.html")
    p = page.page
    text = 'section[data-section="text"] .text'
    assert p.locator(f"{text} .mark-cached").count() == 4
    assert p.locator(f"{text} .mark-recomputed").count() == 1
    assert p.locator(f"{text} .mark-rejected").count() == 1
    legend = p.locator('section[data-section="text"] .legend').inner_text()
    assert "prefix cache (4)" in legend and "preemption" in legend and "rejected (1)" in legend
    p.locator(f'{text} .tok[data-p="7"]').hover()
    assert "draft proposed here was rejected" in p.locator(".tip").inner_text()
    p.locator(f'{text} .tok[data-p="1"]').hover()
    assert "prefix cache" in p.locator(".tip").inner_text()
    page.clean()


def test_a_rejected_draft_in_the_output_is_drawn(browser, real_trace, tmp_path: Path):
    """Drafts are proposed for output positions: their red mark must win over the output tokens' own underline."""
    first_output = len(real_trace.document["prompt_token_ids"])
    arrays = dict(real_trace.arrays)
    arrays.update({"drafted.position": np.array([first_output + 1, first_output + 2]),
                   "drafted.rejected": np.array([0, 1]), "recomputed.position": np.array([first_output + 2])})
    trace = StoredTrace(document=real_trace.document, arrays=arrays, path=real_trace.path)
    page = open_report(browser, render_html(trace), tmp_path, "output-marks.html")
    shadow = page.page.locator(f'section[data-section="text"] .text .tok[data-p="{first_output + 2}"]').evaluate(
        "e => getComputedStyle(e).boxShadow")
    assert "rgb(215, 48, 31)" in shadow and "rgb(128, 90, 213)" in shadow, shadow  # rejected and recomputed
    plain = page.page.locator(f'section[data-section="text"] .text .tok[data-p="{first_output + 1}"]').evaluate(
        "e => getComputedStyle(e).boxShadow")
    assert "rgb(215, 48, 31)" not in plain and "rgb(159, 179, 200)" in plain, plain  # an output token's underline
    page.clean()
