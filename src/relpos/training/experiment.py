"""The K sweep: where does the clip distance matter?

Trains one small model per (task, position scheme, depth) at length 64, evaluates each at
several lengths with accuracy broken down by dependency distance, and writes
``results.json``, figures and ``report.md``. Every statement in the report is computed from
the numbers of the run; none is written in advance.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from relpos.tasks import Task, build_task
from relpos.training.checkpoint import atomic_write_bytes, atomic_write_json
from relpos.training.trainer import TrainConfig, train

__all__ = ["ExperimentConfig", "RunSpec", "make_report", "plan", "run_experiment"]

#: Differences (percentage points) the report calls "small" / "large". Stated in the report.
SMALL_PP = 2.0
LARGE_PP = 5.0


@dataclass
class ExperimentConfig:
    """What the sweep trains and evaluates (defaults: the full experiment)."""

    tasks: tuple[str, ...] = ("recall", "agree")
    ks: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)
    depths: tuple[int, ...] = (1, 2)
    baselines: tuple[str, ...] = ("learned", "sinusoidal")
    train_length: int = 64
    eval_lengths: tuple[int, ...] = (64, 128, 256, 512)
    steps: int = 180
    batch_size: int = 32
    d_model: int = 64
    num_heads: int = 4
    lr: float = 1e-2
    warmup: int = 20
    eval_tokens: int = 8192
    seed: int = 0
    threads: int = 1
    preset: str = "full"

    @classmethod
    def quick(cls) -> ExperimentConfig:
        """A smaller sweep for a few minutes on 2 CPU cores."""
        return cls(
            ks=(0, 2, 4, 16, 32, 64),
            depths=(1,),
            baselines=("learned",),
            steps=120,
            eval_tokens=4096,
            preset="quick",
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class RunSpec:
    """One training run of the sweep."""

    task: str
    positions: str  # "relative" | "learned" | "sinusoidal" | "none"
    k: int  # clip distance (relative only; 0 otherwise)
    depth: int

    @property
    def model(self) -> str:
        """Row label: ``K=8`` or the baseline's name."""
        return f"K={self.k}" if self.positions == "relative" else self.positions

    @property
    def name(self) -> str:
        return f"{self.task}-{self.model.replace('=', '')}-depth{self.depth}"


def plan(config: ExperimentConfig) -> list[RunSpec]:
    """The runs of the sweep, in order."""
    runs = []
    for task in config.tasks:
        for depth in config.depths:
            runs += [RunSpec(task, "relative", k, depth) for k in config.ks]
            runs += [RunSpec(task, b, 0, depth) for b in config.baselines]
    return runs


def _model_config(spec: RunSpec, task: Task, config: ExperimentConfig) -> Any:
    from relpos.models import ModelConfig

    relative = spec.positions == "relative"
    return ModelConfig(
        vocab_size=task.vocab_size,
        d_model=config.d_model,
        num_layers=spec.depth,
        num_heads=config.num_heads,
        max_distance=spec.k,
        relative_keys=relative,
        relative_values=relative,
        positions=spec.positions,
        max_length=max(*config.eval_lengths, config.train_length),
        causal=True,
    )


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
    reuse: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train and evaluate every run of :func:`plan`; write results, figures and report.

    Args:
        config: the sweep.
        out_dir: output directory (``results.json``, ``report.md``, ``*.png``, ``runs/``).
        progress: show a progress bar over the sweep.
        reuse: keep finished runs found in ``out_dir/runs`` with the same settings.
        log: where to print tables (None = stdout).

    Returns:
        The results document (also in ``results.json``).
    """
    out = Path(out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    specs = plan(config)
    tasks = {name: build_task(name) for name in config.tasks}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(specs), desc="experiment", unit="run", dynamic_ncols=True, file=sys.stderr
        )
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for spec in specs:
        task = tasks[spec.task]
        model_config = _model_config(spec, task, config)
        train_config = TrainConfig(
            steps=config.steps,
            batch_size=config.batch_size,
            length=config.train_length,
            lr=config.lr,
            warmup=config.warmup,
            seed=config.seed,
            eval_lengths=config.eval_lengths,
            eval_tokens=config.eval_tokens,
        )
        path = out / "runs" / f"{spec.name}.json"
        record = None
        if reuse and path.is_file():
            old = json.loads(path.read_text())
            if (
                old.get("model") == model_config.to_dict()
                and old.get("train") == (train_config.to_dict())
                and old.get("task") == task.config()
            ):
                record = old
        if record is None:
            if bar is not None:
                bar.set_postfix_str(spec.name)
            _, metrics = train(model_config, task, train_config, progress=False)
            record = {
                "spec": asdict(spec),
                "model_label": spec.model,
                "task": metrics["task"],
                "model": metrics["model"],
                "train": metrics["train"],
                "parameters": metrics["parameters"],
                "final_train_loss": metrics["final_train_loss"],
                "final_train_accuracy": metrics["final_train_accuracy"],
                "train_seconds": metrics["train_seconds"],
                "eval": metrics["eval"],
            }
            atomic_write_json(path, record)
        runs.append(record)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - started
    chance = {name: _chance(task) for name, task in tasks.items()}
    results = {
        "config": config.to_dict(),
        "chance": chance,
        "runs": runs,
        "sweep_seconds": elapsed,
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    }
    atomic_write_json(out / "results.json", results)
    figures = write_figures(results, out)
    report = make_report(results, figures=[f.name for f in figures])
    atomic_write_bytes(out / "report.md", report.encode())
    emit = log or print
    emit(report)
    return results


def _chance(task: Task) -> float:
    if task.name == "recall":
        return 1.0 / task.num_symbols  # type: ignore[attr-defined]
    if task.name == "agree":
        return 0.5
    return float("nan")


# ----------------------------------------------------------------------------- analysis


def _eval_at(run: dict[str, Any], length: int) -> dict[str, Any] | None:
    for ev in run["eval"]:
        if ev["length"] == length:
            return ev
    return None


def _by_distance(run: dict[str, Any], length: int) -> dict[int, tuple[float, int]]:
    ev = _eval_at(run, length)
    if ev is None:
        return {}
    table = ev.get("by", {}).get("distance", {})
    return {int(d): (v["accuracy"], v["count"]) for d, v in table.items()}


def _pooled(run: dict[str, Any], length: int, keep: Callable[[int], bool]) -> tuple[float, int]:
    """Accuracy pooled over the distances ``keep`` selects (nan if none)."""
    hits = total = 0.0
    for d, (acc, n) in _by_distance(run, length).items():
        if keep(d):
            hits += acc * n
            total += n
    return (hits / total if total else float("nan")), int(total)


def _around_k(run: dict[str, Any], length: int, k: int) -> list[tuple[float, int]]:
    """Pooled accuracy at d < K, d = K and d > K."""
    return [
        _pooled(run, length, lambda d: d < k),
        _pooled(run, length, lambda d: d == k),
        _pooled(run, length, lambda d: d > k),
    ]


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _pp(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f} pp"


def _find(runs: list[dict], task: str, depth: int, label: str) -> dict | None:
    for r in runs:
        if r["spec"]["task"] == task and r["spec"]["depth"] == depth and r["model_label"] == label:
            return r
    return None


def _group(runs: list[dict], task: str, depth: int) -> list[dict]:
    return [r for r in runs if r["spec"]["task"] == task and r["spec"]["depth"] == depth]


def _distance_table(group: list[dict], length: int) -> list[str]:
    distances = sorted({d for r in group for d in _by_distance(r, length)})
    lines = [
        "| model | " + " | ".join(f"d={d}" for d in distances) + " | all |",
        "|---" * (len(distances) + 2) + "|",
    ]
    for r in group:
        by = _by_distance(r, length)
        ev = _eval_at(r, length)
        cells = [_pct(by[d][0]) if d in by else "" for d in distances]
        overall = _pct(ev["accuracy"]) if ev else ""
        lines.append(f"| {r['model_label']} | " + " | ".join(cells) + f" | {overall} |")
    return lines


def _length_table(group: list[dict], lengths: Sequence[int]) -> list[str]:
    lines = [
        "| model | " + " | ".join(f"L={n}" for n in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for r in group:
        cells = []
        for n in lengths:
            ev = _eval_at(r, n)
            cells.append(_pct(ev["accuracy"]) if ev else "")
        lines.append(f"| {r['model_label']} | " + " | ".join(cells) + " |")
    return lines


def _findings(results: dict[str, Any], task: str, depth: int) -> list[str]:
    runs = results["runs"]
    cfg = results["config"]
    train_len = cfg["train_length"]
    group = _group(runs, task, depth)
    rel = [r for r in group if r["spec"]["positions"] == "relative"]
    out: list[str] = []
    chance = results["chance"][task]
    # 1. Accuracy within vs beyond the clip distance.
    for r in rel:
        k = r["spec"]["k"]
        (below, n_below), (at, n_at), (beyond, n_beyond) = _around_k(r, train_len, k)
        parts = []
        if n_below:
            parts.append(f"d < K: {_pct(below)}")
        if n_at:
            parts.append(f"d = K: {_pct(at)}")
        if n_beyond:
            parts.append(f"d > K: {_pct(beyond)}")
        out.append(f"- K={k}: " + ", ".join(parts) + f" (chance {_pct(chance)}).")
    # 2. The seed's two comparisons.
    k4, k16 = _find(group, task, depth, "K=4"), _find(group, task, depth, "K=16")
    if k4 and k16:
        a, n = _pooled(k4, train_len, lambda d: 10 <= d <= 20)
        b, _ = _pooled(k16, train_len, lambda d: 10 <= d <= 20)
        if n:
            out.append(
                f"- K=4 vs K=16 on dependencies of 10-20 tokens: {_pct(a)} vs {_pct(b)} "
                f"({_pp(b - a)} for K=16; {n} scored positions each)."
            )
        a_all = _eval_at(k4, train_len)["accuracy"]  # type: ignore[index]
        b_all = _eval_at(k16, train_len)["accuracy"]  # type: ignore[index]
        out.append(
            f"- K=4 vs K=16 on all distances: {_pct(a_all)} vs {_pct(b_all)} "
            f"({_pp(b_all - a_all)})."
        )
    k32, k64 = _find(group, task, depth, "K=32"), _find(group, task, depth, "K=64")
    if k32 and k64:
        a = _eval_at(k32, train_len)["accuracy"]  # type: ignore[index]
        b = _eval_at(k64, train_len)["accuracy"]  # type: ignore[index]
        out.append(f"- K=32 vs K=64 on all distances: {_pct(a)} vs {_pct(b)} ({_pp(b - a)}).")
    # 3. Smallest K that comes within SMALL_PP of the best relative model.
    if rel:
        scores = [(r["spec"]["k"], _eval_at(r, train_len)["accuracy"]) for r in rel]  # type: ignore[index]
        best_k, best = max(scores, key=lambda s: s[1])
        enough = min(k for k, s in scores if s >= best - SMALL_PP / 100)
        out.append(
            f"- Best relative model: K={best_k} at {_pct(best)}; the smallest K within "
            f"{SMALL_PP:g} pp of it is K={enough}."
        )
    # 4. Length extrapolation.
    lengths = [n for n in cfg["eval_lengths"] if n != train_len]
    if lengths:
        longest = max(lengths)
        drops = []
        for r in group:
            short, long = _eval_at(r, train_len), _eval_at(r, longest)
            if short and long:
                drops.append((r["model_label"], short["accuracy"], long["accuracy"]))
        rel_drops = [a - b for label, a, b in drops if label.startswith("K=")]
        if rel_drops:
            out.append(
                f"- Length {train_len} -> {longest}: the largest accuracy drop of a relative "
                f"model is {_pp(-max(rel_drops))}."
            )
        for label, a, b in drops:
            if not label.startswith("K="):
                out.append(
                    f"- {label} positions, length {train_len} -> {longest}: {_pct(a)} -> {_pct(b)}."
                )
    return out


def _verdict(diff_pp: float, *, small_is_yes: bool) -> str:
    """'yes'/'no'/'unclear' for a claim that a difference is small (or large)."""
    if diff_pp < SMALL_PP:
        return "yes" if small_is_yes else "no"
    if diff_pp >= LARGE_PP:
        return "no" if small_is_yes else "yes"
    return "unclear"


def _claims(results: dict[str, Any]) -> list[str]:
    """Rows of the claims table, one per (claim, task, depth), with a computed verdict."""
    runs = results["runs"]
    cfg = results["config"]
    n = cfg["train_length"]
    rows = []
    for task in cfg["tasks"]:
        for depth in cfg["depths"]:
            g = _group(runs, task, depth)
            where = f"{task}, depth {depth}"
            k4, k16 = _find(g, task, depth, "K=4"), _find(g, task, depth, "K=16")
            if k4 and k16:
                a, cnt = _pooled(k4, n, lambda d: d > 4)
                b, _ = _pooled(k16, n, lambda d: d > 4)
                if cnt:
                    diff = 100 * (b - a)
                    verdict = _verdict(diff, small_is_yes=False)
                    rows.append(
                        f"| K=4 vs K=16 differ significantly (d > 4) | {where} | "
                        f"{_pct(a)} vs {_pct(b)} ({diff:+.1f} pp) | {verdict} |"
                    )
                a, cnt = _pooled(k16, n, lambda d: 10 <= d <= 20)
                best = max(
                    (
                        _pooled(r, n, lambda d: 10 <= d <= 20)[0]
                        for r in g
                        if r["spec"]["positions"] == "relative"
                    ),
                    default=float("nan"),
                )
                if cnt:
                    gap = 100 * (best - a)
                    verdict = _verdict(gap, small_is_yes=True)
                    rows.append(
                        f"| K=16 suffices for 10-20 token dependencies | {where} | K=16 "
                        f"{_pct(a)}, best relative {_pct(best)} | {verdict} |"
                    )
            k32, k64 = _find(g, task, depth, "K=32"), _find(g, task, depth, "K=64")
            if k32 and k64:
                a = _eval_at(k32, n)["accuracy"]  # type: ignore[index]
                b = _eval_at(k64, n)["accuracy"]  # type: ignore[index]
                diff = 100 * abs(b - a)
                verdict = _verdict(diff, small_is_yes=True)
                rows.append(
                    f"| K=32 vs K=64 differ little | {where} | {_pct(a)} vs {_pct(b)} | {verdict} |"
                )
            k2 = _find(g, task, depth, "K=2")
            rel = [r for r in g if r["spec"]["positions"] == "relative" and r["spec"]["k"] > 2]
            if k2 and rel:
                a = _eval_at(k2, n)["accuracy"]  # type: ignore[index]
                best = max(_eval_at(r, n)["accuracy"] for r in rel)  # type: ignore[index]
                gain = 100 * (best - a)
                verdict = _verdict(gain, small_is_yes=True)
                rows.append(
                    f"| no gain beyond K = 2 (Shaw et al.) | {where} | K=2 {_pct(a)}, best "
                    f"K > 2 {_pct(best)} | {verdict} |"
                )
    return rows


def make_report(results: dict[str, Any], *, figures: Sequence[str] = ()) -> str:
    """The markdown report; every number and verdict is computed from ``results``."""
    cfg = results["config"]
    n = cfg["train_length"]
    lines = [
        "# Where does the clip distance K matter?",
        "",
        f"Tasks: {', '.join(cfg['tasks'])}. Models: relative positions with K in "
        f"{{{', '.join(map(str, cfg['ks']))}}} and absolute baselines "
        f"({', '.join(cfg['baselines']) or 'none'}), "
        f"depth {{{', '.join(map(str, cfg['depths']))}}}, "
        f"d_model {cfg['d_model']}, {cfg['num_heads']} heads, causal. Trained {cfg['steps']} "
        f"steps x {cfg['batch_size']} sequences of length {n} (AdamW, lr {cfg['lr']:g}, "
        f"warmup {cfg['warmup']}, cosine), seed {cfg['seed']}; evaluated on held-out data at "
        f"lengths {', '.join(map(str, cfg['eval_lengths']))} (about {cfg['eval_tokens']} "
        f"tokens per length). Sweep time: {results['sweep_seconds']:.0f} s with "
        f"{cfg['threads']} torch thread(s).",
        "",
        "A relative model can tell offsets apart only up to K: offsets -K and farther all "
        "share the table row -K, so for one attention hop a dependency at d = K is as "
        "ambiguous as one beyond K. Single seed: treat differences of a few points as noise "
        f"(with n scored positions the standard error of an accuracy p is sqrt(p(1-p)/n)). "
        f"The verdicts below use fixed thresholds: a difference below {SMALL_PP:g} pp is "
        f"'small', one of {LARGE_PP:g} pp or more 'large', anything between 'unclear'.",
        "",
        "## The seed's claims, measured",
        "",
        f"| claim | task, depth | measured (accuracy at length {n}) | supported here? |",
        "|---|---|---|---|",
        *_claims(results),
        "",
    ]
    for task in cfg["tasks"]:
        chance = results["chance"][task]
        lines += [f"## Task `{task}` (chance {_pct(chance)})", ""]
        for depth in cfg["depths"]:
            group = _group(results["runs"], task, depth)
            lines += [
                f"### Depth {depth}: accuracy by distance d at length {n}",
                "",
                *_distance_table(group, n),
                "",
                f"### Depth {depth}: accuracy by evaluation length",
                "",
                *_length_table(group, cfg["eval_lengths"]),
                "",
                f"### Depth {depth}: findings",
                "",
                *_findings(results, task, depth),
                "",
            ]
    if figures:
        lines += (
            [
                "## Figures",
                "",
                "Heatmaps: accuracy at the training length by model (rows) and distance "
                "(columns); a white tick marks the first distance d >= K. Curves: accuracy by "
                "evaluation length; the dotted line is chance.",
                "",
            ]
            + [f"![{f}]({f})" for f in figures]
            + [""]
        )
    lines += [
        "## Reproduce",
        "",
        "```",
        _command(cfg),
        "```",
        "",
    ]
    return "\n".join(lines)


def _command(cfg: dict[str, Any]) -> str:
    if cfg.get("preset") == "quick":
        return f"relpos experiment --quick --seed {cfg['seed']}"
    command = f"relpos experiment --seed {cfg['seed']}"
    if cfg.get("preset") == "custom":
        command += (
            f" --tasks {','.join(cfg['tasks'])} --ks {','.join(map(str, cfg['ks']))}"
            f" --depths {','.join(map(str, cfg['depths']))} --steps {cfg['steps']}"
        )
    return command


# ----------------------------------------------------------------------------- figures


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
            group = _group(results["runs"], task, depth)
            distances = sorted({d for r in group for d in _by_distance(r, n)})
            grid = [
                [_by_distance(r, n).get(d, (float("nan"), 0))[0] for d in distances] for r in group
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
            for r in _group(results["runs"], task, depth):
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
