"""The passkey PNG: accuracy against ratio per policy, and accuracy by needle depth."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw_by_ratio(ax: Any, accuracy: dict[str, dict[str, float]], title: str, ylabel: str = "accuracy") -> None:
    """One line per policy of ``{policy: {str(ratio): value}}`` against the ratio; dense as a dashed line."""
    for policy, table in accuracy.items():
        xs = [float(k) for k in table]
        style = dict(linestyle="--", color="black") if policy == "dense" else {}
        if len(xs) == 1 and policy == "dense":
            ax.axhline(next(iter(table.values())), label="dense", **style)
        else:
            ax.plot(xs, list(table.values()), marker="o", label=policy, **style)
    ax.set(xlabel="compression ratio (fraction of the context removed)", ylabel=ylabel, ylim=(-0.05, 1.05),
           title=title)


def plot_passkey(document: dict[str, Any], path: str | Path) -> Path:
    """Draw ``document`` (the ``passkey.json`` object) into a two-panel PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_ratio, by_depth) = plt.subplots(1, 2, figsize=(11, 4.2))
    draw_by_ratio(by_ratio, document["accuracy"], "passkey accuracy by ratio")
    by_ratio.legend()
    for policy, table in document["by_depth"].items():
        style = dict(linestyle="--", color="black") if policy == "dense" else {}
        by_depth.plot([float(k) for k in table], list(table.values()), marker="o", label=policy, **style)
    by_depth.set(xlabel="needle depth", ylabel="accuracy", ylim=(-0.05, 1.05), title="accuracy by needle depth")
    by_depth.legend()
    n = len(document['cases'])
    fig.suptitle(f"{document['model']}: {n} case{'' if n == 1 else 's'}, seed {document['seed']}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
