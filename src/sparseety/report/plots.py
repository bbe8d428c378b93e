"""The report's figures as PNG files (matplotlib, Agg backend), at a fixed pixel size."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from sparseety.errors import InputError
from sparseety.report.timeline import NEVER, EvictionTimeline

FIGSIZE = (10.0, 5.0)  #: inches
DPI = 100  #: so every PNG is 1000 x 500 pixels
STATE_COLORS = np.array([[43, 140, 190], [253, 174, 97], [215, 48, 31], [238, 241, 244], [154, 165, 177]],
                        dtype=np.float64) / 255
STATE_LABELS = ("kept", "evicted by some KV heads", "evicted by all KV heads", "not yet seen", "outside the window")


def save_figures(view: dict[str, Any], directory: Path) -> list[Path]:
    """Write every figure ``view`` has into ``directory``; returns the files, in a stable order."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the PNG directory {directory}: {exc}") from None
    figures = {"trace": _trace_figures, "passkey": _passkey_figures, "ruler": _ruler_figures,
               "faithfulness": _faithfulness_figures, "tune": _tune_figures}[view["kind"]](view)
    written = []
    with plt.rc_context({"font.size": 10, "axes.spines.top": False, "axes.spines.right": False}):
        for name, draw in figures:
            fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
            try:
                draw(fig)
                path = directory / f"{name}.png"
                fig.savefig(path, dpi=DPI)
            except OSError as exc:
                raise InputError(f"cannot write {directory / name}.png: {exc}") from None
            finally:
                plt.close(fig)
            written.append(path)
    return written


def timeline_rgb(timeline: EvictionTimeline, layers: list[int], positions: int, max_axis: int) -> np.ndarray:
    """``[step bins, position bins, 3]`` colours: each cell mixes the state colours by their share.

    Steps and positions past ``max_axis`` are aggregated into bins (a bin of steps shows its last step).
    """
    pb = -(-positions // max_axis) if positions else 1
    sb = -(-timeline.steps // max_axis)
    steps = np.minimum(np.arange(sb - 1, timeline.steps + sb - 1, sb), timeline.steps - 1)[:, None]  # [rows, 1]
    seq = np.minimum(timeline.prompt_len + steps, positions)
    pos = np.arange(positions)[None, :]
    counts = np.zeros((steps.shape[0], positions, 5))
    for layer in layers:
        first, full = timeline.first_step[layer][None, :], timeline.all_step[layer][None, :]
        unseen = pos >= seq
        evicted = ~unseen & (full != NEVER) & (full <= steps)
        hidden = np.zeros_like(evicted)
        if timeline.window_edge is not None:
            hidden = ~unseen & ~evicted & (pos < timeline.window_edge[layer][steps])
        partly = ~unseen & ~evicted & ~hidden & (first != NEVER) & (first <= steps)
        kept = ~unseen & ~evicted & ~hidden & ~partly
        for index, mask in enumerate((kept, partly, evicted, unseen, hidden)):
            counts[..., index] += mask
    cols = -(-positions // pb)
    padded = np.zeros((steps.shape[0], cols * pb, 5))
    padded[:, :positions] = counts
    binned = padded.reshape(steps.shape[0], cols, pb, 5).sum(axis=2)
    share = binned / np.maximum(binned.sum(axis=-1, keepdims=True), 1)
    return share @ STATE_COLORS


def _trace_figures(view: dict[str, Any]) -> list[tuple[str, Any]]:
    """The trace report's figures, ``(file name, draw(fig))``, for each part ``view`` holds, in a fixed order."""
    shown = {
        "importance": view["importance"] is not None,
        "timeline": view["timeline"] is not None and bool(view["positions"]),
        "kept_fraction": bool(view["kept_fraction"]),
        "compare_kl": bool(_kl_per_step(view)),
        "moe_load": bool(view["moe"]),
        "window_frees": bool(view.get("window_frees")),
        "drafts": bool(view["drafts"]),
        "pruning": bool(view["pruning"]),
    }
    draws = {"importance": _importance, "timeline": _timeline, "kept_fraction": _kept_fraction,
             "compare_kl": _compare_kl, "moe_load": _moe_load, "window_frees": _window_frees, "drafts": _drafts,
             "pruning": _pruning}
    return [(name, functools.partial(draws[name], view=view)) for name, show in shown.items() if show]


def _kl_per_step(view: dict[str, Any]) -> list[float | None] | None:
    """KL(dense || sparse) per decode step from the comparison against dense, when the view has one."""
    compare = view.get("compare") or {}
    return (compare.get("fidelity") or {}).get("kl_per_step")


def _timeline(fig: Any, view: dict[str, Any]) -> None:
    """Each position's state at each step (``view["layer"]`` or all layers), and the slots held beside it."""
    from matplotlib.patches import Patch

    layer = view["layer"]
    layer_name = "all layers" if layer is None else f"layer {layer}"
    timeline: EvictionTimeline = view["timeline"]
    layers = list(range(view["layers"])) if layer is None else [layer]
    ax = fig.add_axes((0.07, 0.12, 0.62, 0.78))
    rgb = timeline_rgb(timeline, layers, view["positions"], view["max_axis"])
    ax.imshow(rgb, aspect="auto", interpolation="nearest",
              extent=(0, view["positions"], timeline.steps - 0.5, -0.5))
    ax.axvline(view["prompt_len"], color="#1f2933", linestyle=":", linewidth=1)
    ax.set(xlabel="position", ylabel="decode step (0 = prefill)", title=f"Eviction timeline, {layer_name}")
    states = len(STATE_LABELS) if timeline.window_edge is not None else 4
    ax.legend(handles=[Patch(color=c, label=t) for c, t in zip(STATE_COLORS[:states], STATE_LABELS)],
              loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=states, fontsize=8, frameon=False)
    side = fig.add_axes((0.77, 0.12, 0.21, 0.78))
    kept = timeline.kept_per_step.mean(axis=0) if layer is None else timeline.kept_per_step[layer]
    steps = np.arange(timeline.steps)
    side.plot(kept, steps, color="#2b8cbe", label="slots held", zorder=3)
    side.plot(np.minimum(view["prompt_len"] + steps, view["positions"]), steps, color="#9aa5b1", label="sequence")
    if view["budget"]:
        side.axvline(view["budget"], color="#d7301f", linestyle="--", label=f"budget {view['budget']}")
    side.invert_yaxis()
    side.set(xlabel="tokens per KV head", title="slots held")
    side.legend(fontsize=8, frameon=False)


def _kept_fraction(fig: Any, view: dict[str, Any]) -> None:
    """The final kept fraction of each layer (the viewed layer darker)."""
    layer = view["layer"]
    ax = fig.add_subplot()
    values = view["kept_fraction"]
    colors = ["#2b8cbe" if layer in (None, i) else "#a6cee3" for i in range(len(values))]
    ax.bar(range(len(values)), values, color=colors)
    ax.set(xlabel="layer", ylabel="kept fraction (final)", ylim=(0, 1), title="Kept fraction per layer")


def _compare_kl(fig: Any, view: dict[str, Any]) -> None:
    """KL divergence from dense at each decode step (a missing step left as a gap)."""
    kl = _kl_per_step(view) or []
    ax = fig.add_subplot()
    values = np.array([np.nan if v is None else v for v in kl], dtype=float)
    ax.plot(np.arange(len(values)), values, marker="o", markersize=3, color="#6b46c1")
    ax.set(xlabel="decode step", ylabel="KL divergence (nats)", title="KL(dense ‖ sparse) per step")
    ax.set_ylim(bottom=0)


def _moe_load(fig: Any, view: dict[str, Any]) -> None:
    """Each layer's expert load (the first grid the trace has: vLLM's routed share, else the top-1 share)."""
    moe = view["moe"]
    ax = fig.add_subplot()
    grid = moe["grids"][0]
    image = ax.imshow(np.array(moe[grid]), aspect="auto", cmap="Blues", interpolation="nearest")
    ax.set_yticks(range(len(moe["layers"])), [str(x) for x in moe["layers"]])
    ax.set(xlabel="expert", ylabel="layer", title=f"Expert load: {moe['labels'][grid]}")
    fig.colorbar(image, ax=ax, label=moe["labels"][grid])


def _window_frees(fig: Any, view: dict[str, Any]) -> None:
    """KV memory the windowed KV-cache groups of a vLLM request returned, cumulative over the steps."""
    w = view["window_frees"]
    ax = fig.add_subplot()
    ax.step(w["steps"], np.asarray(w["bytes"]) / 2**20, where="post", color="#2b8cbe")
    ax.set(xlabel="decode step (0: prefill)", ylabel="freed so far (MiB)",
           title=f"KV freed by sliding windows: {w['freed_blocks']} blocks")
    ax.set_ylim(bottom=0)


def _drafts(fig: Any, view: dict[str, Any]) -> None:
    """Speculative draft tokens accepted and rejected at each decode step."""
    d = view["drafts"]
    ax = fig.add_subplot()
    ax.bar(d["step"], d["accepted"], color="#2f855a", label="accepted")
    ax.bar(d["step"], d["rejected"], bottom=d["accepted"], color="#d7301f", label="rejected")
    ax.set(xlabel="decode step", ylabel="draft tokens", title="Speculative drafts per step")
    ax.legend(frameon=False)


def _pruning(fig: Any, view: dict[str, Any]) -> None:
    """Tokens each layer processed and pruned."""
    p = view["pruning"]
    ax = fig.add_subplot()
    ax.bar(p["layers"], p["remaining"], color="#2b8cbe", label="tokens processed")
    ax.bar(p["layers"], p["pruned"], bottom=p["remaining"], color="#fdae61", label="pruned")
    ax.set(xlabel="layer", ylabel="tokens", title="Tokens per layer after pruning")
    ax.legend(frameon=False)


def _importance(fig: Any, view: dict[str, Any]) -> None:
    values = view["importance"][1:].astype(np.float32)
    positions = values.shape[1]
    bins = -(-positions // view["max_axis"])
    if bins > 1:
        padded = np.full((values.shape[0], -(-positions // bins) * bins), np.nan, dtype=np.float32)
        padded[:, :positions] = values
        values = np.nanmax(padded.reshape(values.shape[0], -1, bins), axis=2)
    ax = fig.add_subplot()
    image = ax.imshow(np.sqrt(np.clip(values, 0, None)), aspect="auto", cmap="Oranges", interpolation="nearest",
                      extent=(0, positions, values.shape[0] - 0.5, -0.5))
    ax.axvline(view["prompt_len"], color="#1f2933", linestyle=":", linewidth=1)
    ax.set(xlabel="position" + (f" (max over bins of {bins})" if bins > 1 else ""), ylabel="layer",
           title="Attention received while generating (square root)")
    fig.colorbar(image, ax=ax, label="√ importance")


def _passkey_figures(view: dict[str, Any], title: str = "Passkey accuracy by policy and ratio") -> list[tuple[str, Any]]:
    def heat(grid: dict[str, Any], xlabel: str, title: str) -> Any:
        def draw(fig: Any) -> None:
            ax = fig.add_subplot()
            values = np.array([[np.nan if v is None else v for v in row] for row in grid["values"]], dtype=float)
            image = ax.imshow(values.reshape(len(grid["rows"]), len(grid["columns"])), vmin=0, vmax=1, cmap="Blues",
                              aspect="auto")
            ax.set_xticks(range(len(grid["columns"])), grid["columns"])
            ax.set_yticks(range(len(grid["rows"])), grid["rows"])
            for (i, j), v in np.ndenumerate(values):
                if not np.isnan(v):
                    ax.text(j, i, f"{v:.0%}", ha="center", va="center", color="white" if v > 0.55 else "#1f2933")
            ax.set(xlabel=xlabel, ylabel="policy", title=title)
            fig.colorbar(image, ax=ax, label="accuracy")

        return draw

    figures = []
    if view["accuracy"]["rows"]:
        figures.append(("passkey_accuracy", heat(view["accuracy"], "compression ratio", title)))
    if view["by_depth"]["rows"]:
        figures.append(("passkey_depth", heat(view["by_depth"], "needle depth", "Passkey accuracy by depth")))
    return figures


def _ruler_figures(view: dict[str, Any]) -> list[tuple[str, Any]]:
    """The all-tasks grid and one per task, drawn as the passkey heat maps are."""
    grids = [("ruler_accuracy", view["accuracy"], "Mean recall over all tasks")]
    grids += [(f"ruler_{t['name']}", t["grid"], f"{t['name']}: recall") for t in view["tasks"]]
    figures = []
    for name, grid, title in grids:
        if grid["rows"]:
            (_, draw), = _passkey_figures({"accuracy": grid, "by_depth": {"rows": []}}, title=title)
            figures.append((name, draw))
    return figures


def _faithfulness_figures(view: dict[str, Any]) -> list[tuple[str, Any]]:
    """Comprehensiveness and sufficiency against the share of prompt tokens, one line per ranking."""
    def curve(key: str, title: str) -> Any:
        def draw(fig: Any) -> None:
            ax = fig.add_subplot()
            for row in view["table"]:
                ax.plot(view["percents"], row[key], marker="o", label=row["method"])
            ax.set(xlabel="% of prompt tokens", ylabel="drop of log p(answer) (nats)", title=title)
            ax.legend(frameon=False, fontsize=8)

        return draw

    if not view["table"]:
        return []
    return [("faithfulness_comprehensiveness", curve("comprehensiveness", "Comprehensiveness: top k% deleted")),
            ("faithfulness_sufficiency", curve("sufficiency", "Sufficiency: only top k% kept"))]


def _tune_figures(view: dict[str, Any]) -> list[tuple[str, Any]]:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        curve = view["curve"]
        x = [p["budget"] for p in curve]
        y = [np.nan if p["value"] is None else p["value"] for p in curve]
        ax.plot(x, y, color="#2b6cb0")
        ax.scatter(x, y, c=["#2f855a" if p["meets"] else "#d7301f" for p in curve], zorder=3)
        if view["threshold"] is not None:
            ax.axhline(view["threshold"], color="#d7301f", linestyle="--", label=f"threshold {view['threshold']}")
            ax.legend(frameon=False)
        ax.set(xlabel="budget (tokens per KV head)", ylabel=view["metric"] or "value", title=view["title"])

    return [("tune_curve", draw)] if view["curve"] else []
