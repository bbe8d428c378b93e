"""The RULER PNG: recall against compression ratio per policy, one panel per task plus the mean."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sparseety.suites.passkey_plot import draw_by_ratio


def plot_ruler(document: dict[str, Any], path: str | Path) -> Path:
    """Draw ``document`` (the ``ruler.json`` object) into a PNG at ``path``: a panel per task, then all tasks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(task, table) for task, table in document["by_task"].items()]
    panels.append(("all tasks", document["accuracy"]))
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, (title, table) in zip(axes.flat, panels):
        draw_by_ratio(ax, table, title, ylabel="recall")
        ax.set_xlim(-0.03, 1.0)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[len(panels) - 1].legend(fontsize="small", ncol=2)
    n = len(document["cases"])
    fig.suptitle(f"{document['model']}: RULER-style tasks, {n} case{'' if n == 1 else 's'}, seed {document['seed']}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
