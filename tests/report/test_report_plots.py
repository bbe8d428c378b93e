"""PNG figures: valid images of the fixed size, and the timeline colours match the states."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from report_helpers import png_size

from sparseety.report import write_pngs
from sparseety.report.data import trace_view
from sparseety.report.plots import (
    DPI,
    FIGSIZE,
    STATE_COLORS,
    save_figures,
    timeline_rgb,
)
from sparseety.report.timeline import build_timeline
from sparseety.store import StoredTrace

SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def test_trace_figures_are_pngs_of_the_expected_size(real_trace, tmp_path: Path):
    paths = write_pngs(real_trace, tmp_path / "figs", layer=3)
    assert [p.name for p in paths] == ["importance.png", "timeline.png", "kept_fraction.png"]
    for path in paths:
        assert png_size(path) == SIZE == (1000, 500)
    from PIL import Image

    with Image.open(paths[1]) as image:
        image.verify()


def test_moe_and_draft_figures(moe_trace, tmp_path: Path):
    names = [p.name for p in save_figures(trace_view(moe_trace), tmp_path)]
    assert "moe_load.png" in names and "drafts.png" in names
    assert all(png_size(tmp_path / n) == SIZE for n in names)
    assert "window_frees.png" not in names


def test_window_frees_figure_of_a_vllm_windowed_trace(moe_trace, tmp_path: Path):
    document = {**moe_trace.document, "vllm": {"window": {"layers": {"0": 8}, "freed_blocks": 3, "freed_bytes": 3 * 2**20,
                                                          "frees": [[0, 0, 1, 2**20], [2, 0, 2, 2 * 2**20]]}}}
    view = trace_view(StoredTrace(document=document, arrays=moe_trace.arrays, path=moe_trace.path))
    names = [p.name for p in save_figures(view, tmp_path)]
    assert "window_frees.png" in names and png_size(tmp_path / "window_frees.png") == SIZE


def test_passkey_and_tune_figures(tmp_path: Path):
    import json

    passkey = tmp_path / "passkey.json"
    passkey.write_text(json.dumps({"kind": "passkey", "results": [], "accuracy": {"h2o": {"0.5": 0.5, "0.8": 0.0}},
                                   "by_depth": {"h2o": {"0.1": 1.0, "0.9": 0.0}}}))
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"kind": "tune", "policy": "h2o", "metric": "rouge_l", "threshold": 0.8,
                                "curve": [{"budget": 8, "ratio": 0.9, "value": 0.3, "meets": False},
                                          {"budget": 32, "ratio": 0.5, "value": 0.9, "meets": True}],
                                "answer": {"budget": 32}}))
    written = write_pngs(passkey, tmp_path / "p") + write_pngs(tune, tmp_path / "t")
    assert [p.name for p in written] == ["passkey_accuracy.png", "passkey_depth.png", "tune_curve.png"]
    assert all(png_size(p) == SIZE for p in written)


def test_timeline_colours_follow_the_states():
    events = {"evicted.step": np.array([1, 2]), "evicted.layer": np.array([0, 0]),
              "evicted.kv_head": np.array([0, 1]), "evicted.position": np.array([1, 1])}
    timeline = build_timeline(events, num_layers=1, positions=6, kv_heads=2, steps=3, prompt_len=4)
    rgb = timeline_rgb(timeline, [0], positions=6, max_axis=2000)
    kept, partly, evicted, unseen, _ = STATE_COLORS
    expected = [[kept, kept, kept, kept, unseen, unseen],
                [kept, partly, kept, kept, kept, unseen],
                [kept, evicted, kept, kept, kept, kept]]
    np.testing.assert_allclose(rgb, np.array(expected))
    binned = timeline_rgb(timeline, [0], positions=6, max_axis=3)  # bins of 2 positions
    np.testing.assert_allclose(binned[2], [(kept + evicted) / 2, kept, kept])


def test_timeline_shows_what_a_sliding_window_hides():
    """Window edges (step 0: 1, step 2: 3) hide the positions below them; an edge carries over a step without one."""
    arrays = {"evicted.step": np.array([1]), "evicted.layer": np.array([0]), "evicted.kv_head": np.array([0]),
              "evicted.position": np.array([4]),
              "window.step": np.array([0, 2]), "window.layer": np.array([0, 0]), "window.kv_head": np.array([-1, -1]),
              "window.position": np.array([1, 3])}
    timeline = build_timeline(arrays, num_layers=1, positions=6, kv_heads=1, steps=3, prompt_len=4)
    np.testing.assert_array_equal(timeline.window_edge, [[1, 1, 3]])
    assert [timeline.state(0, s).tolist() for s in range(3)] == [[4, 1, 1, 1, 0, 0], [4, 1, 1, 1, 3, 0],
                                                                  [4, 4, 4, 1, 3, 1]]
    np.testing.assert_allclose(timeline.kept_per_step[0], [3, 3, 2])  # held: seen - evicted - hidden
    kept, _, evicted, unseen, window = STATE_COLORS
    rgb = timeline_rgb(timeline, [0], positions=6, max_axis=2000)
    np.testing.assert_allclose(rgb[2], [window, window, window, kept, evicted, kept])
