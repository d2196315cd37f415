"""Seed planning for the K sweep's inconclusive claims: what would settle one
(:func:`to_settle`): its half-width, and how many seeds (at the spread the seeds show) or
scored positions would put its interval on one side of the threshold."""

from __future__ import annotations

import math
from typing import Any

from relpos.training.experiment.claims import FLOOR
from relpos.training.experiment.results import BPC_SMALL
from relpos.training.experiment.stats import Interval, t_quantile

__all__ = ["NARROW_PP", "to_settle"]

#: An inconclusive claim is "shown within" this half-width (pp of accuracy; bits per
#: character: BPC_SMALL).
NARROW_PP = 5.0
_MAX_SEEDS = 200


def _seeds_for(spread: float, half: float) -> int | None:
    """The fewest seeds whose t interval at the seeds' standard deviation ``spread`` is
    narrower than ``half`` (None beyond :data:`_MAX_SEEDS`)."""
    for m in range(2, _MAX_SEEDS + 1):
        if t_quantile(m - 1) * spread / math.sqrt(m) < half:
            return m
    return None


def to_settle(row: dict[str, Any]) -> str:
    """What an inconclusive row would take to decide (and whether it is already narrow)."""
    iv: Interval | None = row.get("interval")
    if row["verdict"].startswith("inconclusive (not learned"):
        return ("training until the subset is learned: no compared model reaches "
                f"{100 * FLOOR:g}% on it")
    if "reference" in row:  # the range claim: which K are shown enough and short
        missing: list[str] = []
        if row.get("enough") is None:
            missing.append(f"a K below {row['reference']} shown within the margin of it")
        if row.get("short") is None or row["short"] < 8:
            missing.append("K=8 or a larger K shown short of it")
        said = ("the gaps to the reference narrowed until there is " + " and ".join(missing)
                if missing else "the gaps to the reference narrowed")
        # Each K between the two, shown either way, moves one of them.
        for lab, gap in row.get("undecided", ()):
            said += f"; {lab} shown either way: " + _seeds_to_decide(
                gap, row["threshold"], "above", row.get("unit", "pp"))
        return said
    if iv is None or math.isnan(iv.mean) or not row.get("kind"):
        return "a narrower interval"
    return _seeds_to_decide(iv, row["threshold"], row["kind"], row.get("unit", "pp"))


def _seeds_to_decide(iv: Interval, thr: float, kind: str, unit: str) -> str:
    """How far ``iv`` is from deciding its claim (``kind`` ``above`` / ``below`` /
    ``within`` ``thr``): its half-width, and the seeds or positions that would do it."""
    scale, fmt = (100.0, "{:.1f} pp") if unit == "pp" else (1.0, "{:.3f}")
    dist = abs(abs(iv.mean) - thr) if kind == "within" else abs(iv.mean - thr)
    narrow = NARROW_PP / 100 if unit == "pp" else BPC_SMALL
    said = f"half-width {fmt.format(iv.half * scale)}"
    if unit in ("pp", "bits"):
        said += (" (within ±" + fmt.format(narrow * scale) + ")" if iv.half <= narrow
                 else " (wider than ±" + fmt.format(narrow * scale) + ")")
    if dist * scale < (0.05 if unit == "pp" else 0.0005):
        return f"{said}; the mean sits on the threshold: no number of runs decides it"
    if iv.source == "positions":
        more = (iv.half / dist) ** 2
        return (f"{said}, set by the scored positions: about {more:.1f}x as many (more "
                "evaluation tokens or seeds) would decide it")
    spread = iv.half * math.sqrt(iv.n) / t_quantile(max(iv.n - 1, 1))
    need = _seeds_for(spread, dist)
    if need is None:
        return (f"{said}, set by the seeds; the mean is {fmt.format(dist * scale)} from the "
                f"threshold: over {_MAX_SEEDS} seeds at this spread")
    return (f"{said}, set by the seeds (sd {fmt.format(spread * scale)}): about {need} "
            f"seeds at this spread would decide it")
