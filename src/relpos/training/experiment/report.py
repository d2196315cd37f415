"""The report of the K sweep: tables, findings, verdicts on the seed's claims, figures.

Every number and statement in ``report.md`` is computed from the results document that
:func:`relpos.training.experiment.run_experiment` writes (``results.json``); none is written
in advance. :func:`make_report` is pure (results in, markdown out); :func:`write_report`
also draws the figures (:mod:`relpos.training.experiment.figures`) and writes the file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relpos._io import atomic_write_text
from relpos.training.experiment.results import (
    accuracy,
    around_k,
    both,
    by_distance,
    eval_at,
    pooled,
    runs_of,
)

__all__ = ["LARGE_PP", "SMALL_PP", "make_report", "write_report"]

#: Differences (percentage points) the report calls "small" / "large". Stated in the report.
SMALL_PP = 2.0
LARGE_PP = 5.0


def write_report(results: dict[str, Any], out: Path) -> str:
    """Draw the figures into ``out``, write ``out/report.md`` and return its text."""
    from relpos.training.experiment.figures import write_figures

    figures = write_figures(results, out)
    report = make_report(results, figures=[f.name for f in figures])
    atomic_write_text(out / "report.md", report)
    return report


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _pp(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f} pp"


def _distance_table(group: list[dict], length: int) -> list[str]:
    distances = sorted({d for r in group for d in by_distance(r, length)})
    lines = [
        "| model | " + " | ".join(f"d={d}" for d in distances) + " | all |",
        "|---" * (len(distances) + 2) + "|",
    ]
    for r in group:
        by = by_distance(r, length)
        ev = eval_at(r, length)
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
            ev = eval_at(r, n)
            cells.append(_pct(ev["accuracy"]) if ev else "")
        lines.append(f"| {r['model_label']} | " + " | ".join(cells) + " |")
    return lines


def _findings(results: dict[str, Any], task: str, depth: int) -> list[str]:
    runs = results["runs"]
    cfg = results["config"]
    train_len = cfg["train_length"]
    group = runs_of(runs, task, depth)
    rel = [r for r in group if r["spec"]["positions"] == "relative"]
    out: list[str] = []
    chance = results["chance"][task]
    # 1. Accuracy within vs beyond the clip distance.
    for r in rel:
        k = r["spec"]["k"]
        (below, n_below), (at, n_at), (beyond, n_beyond) = around_k(r, train_len, k)
        parts = []
        if n_below:
            parts.append(f"d < K: {_pct(below)}")
        if n_at:
            parts.append(f"d = K: {_pct(at)}")
        if n_beyond:
            parts.append(f"d > K: {_pct(beyond)}")
        out.append(f"- K={k}: " + ", ".join(parts) + f" (chance {_pct(chance)}).")
    # 2. The seed's two comparisons.
    k4_k16 = both(group, "K=4", "K=16")
    if k4_k16:
        (a, n), (b, _) = (pooled(r, train_len, lambda d: 10 <= d <= 20) for r in k4_k16)
        if n:
            out.append(
                f"- K=4 vs K=16 on dependencies of 10-20 tokens: {_pct(a)} vs {_pct(b)} "
                f"({_pp(b - a)} for K=16; {n} scored positions each)."
            )
    for pair in (k4_k16, both(group, "K=32", "K=64")):
        if pair:
            a, b = (accuracy(r, train_len) for r in pair)
            out.append(
                f"- {pair[0]['model_label']} vs {pair[1]['model_label']} on all distances: "
                f"{_pct(a)} vs {_pct(b)} ({_pp(b - a)})."
            )
    # 3. Smallest K that comes within SMALL_PP of the best relative model.
    if rel:
        scores = [(r["spec"]["k"], accuracy(r, train_len)) for r in rel]
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
            short, long = eval_at(r, train_len), eval_at(r, longest)
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
    cfg = results["config"]
    return [
        row
        for task in cfg["tasks"]
        for depth in cfg["depths"]
        for row in _claims_of(
            runs_of(results["runs"], task, depth), f"{task}, depth {depth}", cfg["train_length"]
        )
    ]


def _claims_of(g: list[dict], where: str, n: int) -> list[str]:
    """The claims rows of the runs ``g`` of one (task, depth), at length ``n``."""
    rows = []

    def claim(text: str, measured: str, diff_pp: float, *, small_is_yes: bool) -> None:
        verdict = _verdict(diff_pp, small_is_yes=small_is_yes)
        rows.append(f"| {text} | {where} | {measured} | {verdict} |")

    k4_k16 = both(g, "K=4", "K=16")
    if k4_k16:
        (a, cnt), (b, _) = (pooled(r, n, lambda d: d > 4) for r in k4_k16)
        if cnt:
            diff = 100 * (b - a)
            claim("K=4 vs K=16 differ significantly (d > 4)",
                  f"{_pct(a)} vs {_pct(b)} ({diff:+.1f} pp)", diff, small_is_yes=False)
        a, cnt = pooled(k4_k16[1], n, lambda d: 10 <= d <= 20)
        best = max(
            (pooled(r, n, lambda d: 10 <= d <= 20)[0]
             for r in g if r["spec"]["positions"] == "relative"),
            default=float("nan"),
        )
        if cnt:
            claim("K=16 suffices for 10-20 token dependencies",
                  f"K=16 {_pct(a)}, best relative {_pct(best)}", 100 * (best - a),
                  small_is_yes=True)
    k32_k64 = both(g, "K=32", "K=64")
    if k32_k64:
        a, b = (accuracy(r, n) for r in k32_k64)
        claim("K=32 vs K=64 differ little", f"{_pct(a)} vs {_pct(b)}", 100 * abs(b - a),
              small_is_yes=True)
    k2 = next((r for r in g if r["model_label"] == "K=2"), None)
    rel = [r for r in g if r["spec"]["positions"] == "relative" and r["spec"]["k"] > 2]
    if k2 and rel:
        a, best = accuracy(k2, n), max(accuracy(r, n) for r in rel)
        claim("no gain beyond K = 2 (Shaw et al.)", f"K=2 {_pct(a)}, best K > 2 {_pct(best)}",
              100 * (best - a), small_is_yes=True)
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
            group = runs_of(results["runs"], task, depth)
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
