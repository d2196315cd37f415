"""How the report of the K sweep writes its numbers: an interval as a percentage, in
percentage points or in bits (:func:`pct`, :func:`pp`, :func:`bits`), a K, and the seeds of
the sweep (:func:`seed_text`, and where some ``pysrc`` models have extra seeds,
:func:`extra_seed_text`, :func:`over`, :func:`extra_models_note`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from relpos.training.experiment.results import CODE
from relpos.training.experiment.stats import Interval

__all__ = [
    "bits",
    "extra_models_note",
    "extra_seed_text",
    "kstr",
    "over",
    "pct",
    "pct_short",
    "pp",
    "seed_text",
    "span",
]


def pct(iv: Interval) -> str:
    """``93.1% [92.0, 94.2]`` (``n/a`` for no number)."""
    if math.isnan(iv.mean):
        return "n/a"
    return f"{100 * iv.mean:.1f}% [{100 * iv.low:.1f}, {100 * iv.high:.1f}]"


def pct_short(iv: Interval) -> str:
    """``93.1 ±1.1``, a table cell (empty for no number)."""
    if math.isnan(iv.mean):
        return ""
    return f"{100 * iv.mean:.1f} ±{100 * iv.half:.1f}"


def pp(iv: Interval) -> str:
    """A difference in percentage points: ``+2.4 pp [+0.3, +4.5]`` (``n/a`` for none)."""
    if math.isnan(iv.mean):
        return "n/a"
    return f"{100 * iv.mean:+.1f} pp [{100 * iv.low:+.1f}, {100 * iv.high:+.1f}]"


def bits(iv: Interval, sign: bool = False) -> str:
    """Bits per character: ``1.234 [1.200, 1.268]`` (``sign``: ``+0.012 [...]``; ``n/a`` for
    no number)."""
    if math.isnan(iv.mean):
        return "n/a"
    f = "+.3f" if sign else ".3f"
    return f"{iv.mean:{f}} [{iv.low:{f}}, {iv.high:{f}}]"


def kstr(k: int | None, none: str) -> str:
    """``K=16``, or ``none`` where there is no K."""
    return none if k is None else f"K={k}"


def span(seeds: Sequence[int]) -> str:
    """``0-9`` for consecutive seeds, else the list."""
    xs = list(seeds)
    if len(xs) > 2 and xs == list(range(xs[0], xs[0] + len(xs))):
        return f"{xs[0]}-{xs[-1]}"
    return ", ".join(map(str, xs))


def seed_text(cfg: dict[str, Any]) -> str:
    """``3 seeds (0, 1, 2)``, or per task when ``pysrc`` has seeds of its own (and its
    models with extra seeds)."""
    seeds = list(cfg.get("seeds", [cfg.get("seed", 0)]))
    code = cfg.get("code_seeds")
    tasks = list(cfg.get("tasks", []))
    if CODE in tasks and tasks != [CODE] and code is not None and list(code) != seeds:
        others = [t for t in tasks if t != CODE]
        said = (f"{len(seeds)} seeds ({span(seeds)}) for {', '.join(others)} and "
                f"{len(code)} ({span(code)}) for {CODE}")
    else:
        shown = list(code) if tasks == [CODE] and code is not None else seeds
        said = f"{len(shown)} seed(s) ({span(shown)})"
    return said + extra_seed_text(cfg)


def extra_seed_text(cfg: dict[str, Any]) -> str:
    """`` (K=128 and unclipped of pysrc: 41 more seeds (20-60); ...)``, or nothing."""
    extra, models = cfg.get("code_extra_seeds") or [], cfg.get("code_extra_models") or []
    if not extra or not models or CODE not in cfg.get("tasks", []):
        return ""
    return (f" ({' and '.join(models)} of {CODE}: {len(extra)} more seeds ({span(extra)}); "
            "a comparison pairs the seeds both its models have)")


def over(iv: Interval, cfg: dict[str, Any]) -> str:
    """`` over 61 seeds`` where some ``pysrc`` models have extra seeds (a comparison's count
    then depends on its models), else nothing."""
    return f" over {iv.n} seeds" if extra_seed_text(cfg) else ""


def extra_models_note(cfg: dict[str, Any], groups: dict[str, list[dict]]) -> str:
    """The sentence on the ``pysrc`` models trained with extra seeds (their rows below are
    means over all of their seeds)."""
    models = [m for m in cfg.get("code_extra_models") or [] if m in groups]
    if not cfg.get("code_extra_seeds") or not models:
        return ""
    counts = ", ".join(f"{m} {len(groups[m])}" for m in models)
    return (f" {' and '.join(models)} are trained with more seeds than the others "
            f"({counts} runs): their rows are means over all of them, and a comparison "
            "pairs the seeds both of its models have.")
