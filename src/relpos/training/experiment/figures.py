"""Figures of the K sweep (need the ``plot`` extra, matplotlib): accuracy heatmaps over
model x distance (in %, cells and colour bar alike; colour scale fitted to the data; d = K
marked by a white bar outlined in black, in the legend), length-extrapolation curves with
each model's 95% interval as a bar beside its point (bands of ten models would cover each
other), chance in the legend, bits per character against K with bands (the absolute
baselines as horizontal lines), and the per-row training signal."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from relpos.training.experiment.results import (
    bpc_interval,
    bracket_counts,
    by_distance,
    configurations,
    curves,
    overall_counts,
    runs_of,
)
from relpos.training.experiment.stats import accuracy_interval

__all__ = ["write_figures"]

CODE = "pysrc"


def _heatmap(ax: Any, grid: list[list[float]], rows: list[str], cols: list[str],
             vmin: float, vmax: float, title: str) -> Any:
    image = ax.imshow(grid, vmin=vmin, vmax=vmax, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cols)), cols, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_title(title, fontsize=9)
    mid = (vmin + vmax) / 2
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=6,
                        color="black" if v > mid else "white")
    return image


def _colorbar(fig: Any, image: Any, axes: Any, label: str) -> None:
    """The heatmaps' colour bar, in % like the cells (whole numbers where the tick is one)."""
    from matplotlib.ticker import FuncFormatter

    def percent(value: float, _: Any) -> str:
        v = 100 * value
        return f"{v:.0f}" if abs(v - round(v)) < 1e-6 else f"{v:.1f}"

    fig.colorbar(image, ax=list(axes), shrink=0.9, label=f"{label}, % (fitted scale)",
                 format=FuncFormatter(percent))


def _range(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    if high - low < 0.02:
        low, high = low - 0.01, high + 0.01
    return low, high


def _outline() -> list[Any]:
    from matplotlib.patheffects import Normal, Stroke

    return [Stroke(linewidth=3.6, foreground="black"), Normal()]


def _k_legend(fig: Any) -> None:
    """The legend of the d = K marks, under the heatmaps."""
    from matplotlib.lines import Line2D

    mark = Line2D([], [], color="white", linewidth=1.8, solid_capstyle="butt",
                  path_effects=_outline())
    fig.legend([mark], ["white bar outlined in black: d = K, from where on every distance "
                        "reads one table row (clipped to K)"],
               loc="outside lower center", fontsize=8, frameon=False, handlelength=2.5)


def _mark_k(ax: Any, labels: list[str], edges: list[int]) -> None:
    """A white bar outlined in black (seen on every colour of the map) at the left edge of
    the first column whose distance reaches K (none where that is the first column: every
    distance shown reaches K)."""
    outline = _outline()
    for row, label in enumerate(labels):
        if not label.startswith("K="):
            continue
        k = int(label[2:])
        cols = [c for c, d in enumerate(edges) if d >= k]
        if cols and cols[0] > 0:
            ax.plot([cols[0] - 0.5] * 2, [row - 0.42, row + 0.42], color="white",
                    linewidth=1.8, solid_capstyle="butt", path_effects=outline, zorder=3)


def write_figures(results: dict[str, Any], out: Path) -> list[Path]:
    """Write the figures of ``results`` into ``out``; returns their paths (none without
    matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    from relpos.training.plotting import save_figure

    cfg = results["config"]
    paths = []
    for task in cfg["tasks"]:
        paths += _curve_figure(results, task, out, Figure, save_figure)
        if task == CODE:
            paths += _code_figures(results, out, Figure, save_figure)
            continue
        n = cfg["train_length"]
        depths = cfg["depths"]
        grids = []
        for depth in depths:
            groups = configurations(runs_of(results["runs"], task, depth))
            distances = sorted({d for g in groups.values() for r in g for d in by_distance(r, n)})
            grid = [[accuracy_interval([by_distance(r, n).get(d, (0, 0)) for r in g]).mean
                     for d in distances] for g in groups.values()]
            grids.append((depth, list(groups), distances, grid))
        vmin, vmax = _range([v for *_, grid in grids for row in grid for v in row])
        fig = Figure(figsize=(4.4 * len(depths) + 0.8, 3.8), layout="constrained")
        axes = fig.subplots(1, len(depths), squeeze=False)[0]
        image = None
        for ax, (depth, labels, distances, grid) in zip(axes, grids, strict=True):
            image = _heatmap(ax, grid, labels, [str(d) for d in distances], vmin, vmax,
                             f"{task}, depth {depth}: subset accuracy by d (length {n})")
            ax.set_xlabel("dependency distance d")
            _mark_k(ax, labels, distances)
        if image is not None:
            _colorbar(fig, image, axes, "subset accuracy")
        _k_legend(fig)
        paths.append(save_figure(fig, out / f"heatmap_{task}.png", dpi=100))

        fig = Figure(figsize=(4.4 * len(depths) + 1.6, 3.4), layout="constrained")
        axes = fig.subplots(1, len(depths), squeeze=False)[0]
        lengths = cfg["eval_lengths"]
        for ax, depth in zip(axes, depths, strict=True):
            groups = configurations(runs_of(results["runs"], task, depth))
            _extrapolation(ax, lengths, [
                (label, [accuracy_interval([overall_counts(r, m) for r in g]) for m in lengths],
                 label.startswith("K=")) for label, g in groups.items()])
            ax.axhline(results["chance"][task], color="gray", linewidth=0.8, linestyle=":",
                       label="chance")
            ax.set_xlabel(f"evaluation length (trained at {n})")
            ax.set_ylabel("overall accuracy")
            ax.set_title(f"{task}, depth {depth}: mean, 95% interval (bar)", fontsize=9)
        handles, names = axes[-1].get_legend_handles_labels()
        last = names.index("chance")  # the models first, chance last
        order = [*(i for i in range(len(names)) if i != last), last]
        axes[-1].legend([handles[i] for i in order], [names[i] for i in order], fontsize=6,
                        loc="center left", bbox_to_anchor=(1.0, 0.5))
        paths.append(save_figure(fig, out / f"extrapolation_{task}.png", dpi=100))
    return paths


def _extrapolation(ax: Any, lengths: list[int], series: list[tuple[str, list[Any], bool]]
                   ) -> None:
    """Each model's mean by evaluation length (``series``: label, intervals, relative),
    with its 95% interval as a bar beside the point: the models of a length sit side by side
    (a filled band per model would cover the others)."""
    from matplotlib import colormaps

    spread = 0.3 if len(series) > 1 else 0.0  # in octaves of length, across the models
    # The relative models in K order along one colour map; the baselines in colours of
    # their own (ten models would run through the default cycle and repeat it).
    ranked = [label for label, _, relative in series if relative]
    others = iter(("black", "tab:red", "tab:gray", "tab:brown"))
    for i, (label, ivs, relative) in enumerate(series):
        shift = 2 ** (spread * (i / max(1, len(series) - 1) - 0.5))
        xs = [m * shift for m in lengths]
        means = [iv.mean for iv in ivs]
        color = (colormaps["viridis"](0.9 * ranked.index(label) / max(1, len(ranked) - 1))
                 if relative else next(others, None))
        ax.errorbar(xs, means, yerr=[[m - iv.low for m, iv in zip(means, ivs, strict=True)],
                                     [iv.high - m for m, iv in zip(means, ivs, strict=True)]],
                    fmt="-o" if relative else "--s", markersize=3, linewidth=1,
                    elinewidth=0.8, capsize=1.5, label=label, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(x) for x in lengths])


def _curve_figure(results: dict[str, Any], task: str, out: Path, Figure: Any, save: Any
                  ) -> list[Path]:
    """Learning curves of ``task``: each metric against the step budget, a thin line per
    seed and a thick one for the mean, per curve model (and depth)."""
    from relpos.training.experiment.results import curve_metrics, depths

    blocks = [(depth, points) for depth in depths(results, task)
              if (points := curves(results["runs"], task, depth))]
    if not blocks:
        return []
    metrics = curve_metrics(results, task)
    panels = [(depth, points, metric) for depth, points in blocks for metric in metrics]
    fig = Figure(figsize=(3.6 * len(panels) + 1.2, 3.4), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (depth, points, (name, value, _, unit)) in zip(axes, panels, strict=True):
        scale = 100.0 if unit == "pp" else 1.0
        budgets = sorted({b for by in points.values() for b in by})
        for label, by in points.items():
            steps = sorted(by)
            seeds = sorted({r["spec"].get("seed", 0) for g in by.values() for r in g})
            means = []
            for b in steps:
                vals = [value(r) for r in by[b] if not math.isnan(value(r))]
                means.append(scale * sum(vals) / len(vals) if vals else math.nan)
            (line,) = ax.plot(steps, means, "-o", linewidth=1.8, markersize=3, label=label)
            for seed in seeds:
                xs = [b for b in steps if any(r["spec"].get("seed", 0) == seed for r in by[b])]
                ys = [scale * value(next(r for r in by[b] if r["spec"].get("seed", 0) == seed))
                      for b in xs]
                ax.plot(xs, ys, "-", color=line.get_color(), linewidth=0.6, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets], fontsize=7)
        ax.set_xlabel("training steps (each budget a run of its own)")
        ax.set_ylabel(name if unit != "pp" else f"{name}, %", fontsize=7)
        where = f"{task}, depth {depth}"
        ax.set_title(where, fontsize=9)
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"{task}: learning curves (thick: mean over seeds; thin: each seed)",
                 fontsize=9)
    return [save(fig, out / f"curves_{task}.png", dpi=100)]


def _code_figures(results: dict[str, Any], out: Path, Figure: Any, save: Any) -> list[Path]:
    from relpos.training.experiment.results import BUCKETS

    cfg = results["config"]
    n = cfg["code_train_length"]
    lengths = [n * f for f in cfg["code_eval_factors"]]
    groups = configurations(runs_of(results["runs"], CODE))
    labels = list(groups)
    paths = []
    # Heatmaps: closing-bracket accuracy by model x opener distance, at 1x and the longest.
    # A bucket in which no closer was scored (no opener that far back in the evaluated
    # windows) is left out, and the axis says so.
    panels = []
    for m in sorted({n, max(lengths)}):
        possible = [f"{lo}-{hi}" for lo, hi in BUCKETS if lo < m]
        buckets = [b for b in possible
                   if any(bracket_counts(r, m, b)[1] for g in groups.values() for r in g)]
        empty = [b for b in possible if b not in buckets]
        grid = [[accuracy_interval([bracket_counts(r, m, b) for r in g]).mean for b in buckets]
                for g in groups.values()]
        panels.append((m, buckets, grid, empty))
    vmin, vmax = _range([v for *_, grid, _ in panels for row in grid for v in row])
    fig = Figure(figsize=(4.6 * len(panels) + 0.8, 4.0), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for ax, (m, buckets, grid, empty) in zip(axes, panels, strict=True):
        image = _heatmap(ax, grid, labels, buckets, vmin, vmax,
                         f"closing-bracket accuracy, length {m}")
        left_out = (f"\n(d = {', '.join(empty)} left out: no closer scored)"
                    if empty else "")
        ax.set_xlabel(f"opener distance d (characters){left_out}")
        _mark_k(ax, labels, [int(b.split("-")[1]) for b in buckets])
    if image is not None:
        _colorbar(fig, image, axes, "subset accuracy")
    _k_legend(fig)
    paths.append(save(fig, out / f"heatmap_{CODE}.png", dpi=100))

    # Bits per character against K, one line per evaluation length, with bands.
    rel = [lab for lab in labels if lab.startswith("K=") or lab == "unclipped"]
    # The absolute baselines the data has, each a line style: a horizontal line per length.
    styles = dict(zip([lab for lab in labels if lab not in rel], ("--", ":", "-."),
                      strict=False))
    fig = Figure(figsize=(7.6, 3.6), layout="constrained")
    ax = fig.subplots()
    xs = list(range(len(rel)))
    for m in lengths:
        ivs = [bpc_interval(groups[lab], m) for lab in rel]
        (line,) = ax.plot(xs, [iv.mean for iv in ivs], "-o", markersize=3, linewidth=1,
                          label=f"length {m} ({m // n}x)")
        ax.fill_between(xs, [iv.low for iv in ivs], [iv.high for iv in ivs],
                        color=line.get_color(), alpha=0.2, linewidth=0)
        for lab, style in styles.items():
            iv = bpc_interval(groups[lab], m)
            if not math.isnan(iv.mean):
                ax.axhline(iv.mean, color=line.get_color(), linewidth=0.9, linestyle=style)
    for lab, style in styles.items():  # legend entries: the style of each baseline
        ax.plot([], [], color="gray", linewidth=0.9, linestyle=style,
                label=f"{lab} positions (each length's colour)")
    ax.set_xticks(xs, [lab.replace("K=", "") for lab in rel], fontsize=7)
    ax.set_xlabel("clip distance K" + (" (horizontal lines: absolute-position baselines)"
                                       if styles else ""))
    ax.set_ylabel("validation bits per character")
    ax.set_title(f"{CODE}: bits per character vs K (trained at {n}), 95% bands", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    paths.append(save(fig, out / f"bpc_{CODE}.png", dpi=100))

    # Length extrapolation: bits per character by evaluation length.
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    _extrapolation(ax, lengths, [(lab, [bpc_interval(groups[lab], m) for m in lengths],
                                  lab in rel) for lab in labels])
    ax.set_xlabel(f"evaluation length (trained at {n})")
    ax.set_ylabel("validation bits per character")
    ax.set_title(f"{CODE}: length extrapolation: mean, 95% interval (bar)", fontsize=9)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    paths.append(save(fig, out / f"extrapolation_{CODE}.png", dpi=100))

    # The per-row training signal.
    signal = {lab: [r["signal"] for r in g if "signal" in r] for lab, g in groups.items()}
    signal = {lab: s for lab, s in signal.items() if s}
    if signal:
        fig = Figure(figsize=(12.0, 3.6), layout="constrained")
        axes = fig.subplots(1, 3)
        for lab, sig in signal.items():
            k = sig[0]["k"]
            ds = list(range(1, k + 1))  # d = 0 has no place on a log axis
            for ax, key in zip(axes, ("pairs_per_batch", "mean_grad_norm", "moved"),
                               strict=True):
                ys = [sum(s[key][d] for s in sig) / len(sig) for d in ds]
                ys = [y if y > 0 else math.nan for y in ys]
                ax.plot(ds, ys, "-", linewidth=1.6 if lab == "unclipped" else 0.9,
                        label=lab, marker="o" if k < 8 else None, markersize=3)
        titles = ("query-key pairs per batch", "mean raw gradient norm per step",
                  "distance moved from init |W - W0|")
        kmax = max(sig[0]["k"] for sig in signal.values())
        for ax, title in zip(axes, titles, strict=True):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.axvline(n - 1, color="gray", linestyle=":", linewidth=0.8)
            if kmax >= n:
                # Rows d >= L: no pair, no gradient, no movement (exact zeros, off a log axis).
                ax.axvspan(n, kmax, color="tab:red", alpha=0.08, linewidth=0)
                ax.text(math.sqrt(n * kmax), 0.5, "rows d >= L:\nnever trained\n(exactly 0)",
                        transform=ax.get_xaxis_transform(), ha="center", fontsize=7,
                        color="tab:red")
                ax.set_xlim(0.8, kmax * 1.2)
            ax.set_xlabel("distance back d (table row)")
            ax.set_title(title, fontsize=9)
        axes[0].text(n - 1, axes[0].get_ylim()[0], " L-1", fontsize=7, color="gray")
        axes[-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.suptitle(f"{CODE}: training signal per relative-table row (trained at {n}; "
                     "rows d >= L are never used in training: no point)", fontsize=9)
        paths.append(save(fig, out / f"signal_{CODE}.png", dpi=100))
    return paths
