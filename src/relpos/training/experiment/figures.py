"""Figures of the K sweep (need the ``plot`` extra, matplotlib): accuracy heatmaps over
model x distance and length-extrapolation curves, one pair per task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relpos.training.experiment.results import by_distance, runs_of

__all__ = ["write_figures"]


def write_figures(results: dict[str, Any], out: Path) -> list[Path]:
    """Heatmaps of accuracy over model x distance and length-extrapolation curves."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    from relpos.plotting import save_figure

    cfg = results["config"]
    n = cfg["train_length"]
    paths = []
    for task in cfg["tasks"]:
        depths = cfg["depths"]
        fig = Figure(figsize=(4.2 * len(depths) + 0.8, 3.6), layout="constrained")
        axes = fig.subplots(1, len(depths), squeeze=False)[0]
        image = None
        for ax, depth in zip(axes, depths, strict=True):
            group = runs_of(results["runs"], task, depth)
            distances = sorted({d for r in group for d in by_distance(r, n)})
            grid = [
                [by_distance(r, n).get(d, (float("nan"), 0))[0] for d in distances] for r in group
            ]
            image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(distances)), [str(d) for d in distances], fontsize=7)
            ax.set_yticks(range(len(group)), [r["model_label"] for r in group], fontsize=7)
            ax.set_xlabel("dependency distance d")
            ax.set_title(f"{task}, depth {depth} (length {n})", fontsize=9)
            for row, r in enumerate(group):
                if r["spec"]["positions"] != "relative":
                    continue
                k = r["spec"]["k"]
                # Mark the cell where d reaches K (beyond it offsets share one row).
                cols = [c for c, d in enumerate(distances) if d >= k]
                if cols:
                    ax.plot(cols[0] - 0.5, row, marker="|", color="white", markersize=9)
        if image is not None:
            fig.colorbar(image, ax=list(axes), shrink=0.9, label="accuracy")
        paths.append(save_figure(fig, out / f"heatmap_{task}.png", dpi=110))

        fig = Figure(figsize=(4.2 * len(depths) + 1.6, 3.4), layout="constrained")
        axes = fig.subplots(1, len(depths), squeeze=False)[0]
        for ax, depth in zip(axes, depths, strict=True):
            for r in runs_of(results["runs"], task, depth):
                xs = [ev["length"] for ev in r["eval"]]
                ys = [ev["accuracy"] for ev in r["eval"]]
                style = "-o" if r["spec"]["positions"] == "relative" else "--s"
                ax.plot(xs, ys, style, markersize=3, linewidth=1, label=r["model_label"])
            ax.set_xscale("log", base=2)
            ax.set_xticks(cfg["eval_lengths"], [str(x) for x in cfg["eval_lengths"]])
            ax.set_ylim(0, 1.02)
            ax.axhline(results["chance"][task], color="gray", linewidth=0.8, linestyle=":")
            ax.set_xlabel(f"evaluation length (trained at {n})")
            ax.set_ylabel("accuracy")
            ax.set_title(f"{task}, depth {depth}", fontsize=9)
        axes[-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        paths.append(save_figure(fig, out / f"extrapolation_{task}.png", dpi=110))
    return paths
