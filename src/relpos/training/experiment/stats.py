"""Intervals and verdicts of the K sweep.

Every number the report compares is a mean over seeds with a 95% interval: the wider of a
Student-t interval over the seeds and an interval over the scored positions (Wilson's for
a pooled accuracy, a normal one for a difference of two accuracies or a mean loss). A claim
gets "yes" or "no" only when its interval lies entirely on one side of the claim's
threshold; otherwise it is "inconclusive".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Interval",
    "accuracy_interval",
    "difference_interval",
    "mean_interval",
    "t_quantile",
    "verdict_above",
    "verdict_below",
    "verdict_within",
    "wilson",
]

Z95 = 1.959963984540054
# Two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (normal beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T95[df - 1] if df <= len(_T95) else Z95


@dataclass(frozen=True)
class Interval:
    """A mean and its 95% interval ``[low, high]``; ``source`` says which interval was wider
    (``"seeds"`` or ``"positions"``); ``n`` the seeds."""

    mean: float
    low: float
    high: float
    n: int
    source: str = "seeds"

    @property
    def half(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict[str, float | int | str]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "seeds": self.n,
                "source": self.source}


NAN = Interval(math.nan, math.nan, math.nan, 0)


def mean_interval(values: Sequence[float], *, data_half: float = 0.0) -> Interval:
    """Mean of ``values`` (one per seed) with the wider of the t interval over them and
    ``mean +- data_half`` (an interval from the data within the seeds)."""
    xs = [float(v) for v in values if not math.isnan(v)]
    if not xs:
        return NAN
    mean = sum(xs) / len(xs)
    seed_half = math.inf if len(xs) == 1 else 0.0
    if len(xs) > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        seed_half = t_quantile(len(xs) - 1) * sd / math.sqrt(len(xs))
    if data_half >= seed_half:
        return Interval(mean, mean - data_half, mean + data_half, len(xs), "positions")
    return Interval(mean, mean - seed_half, mean + seed_half, len(xs), "seeds")


def wilson(hits: float, count: float) -> tuple[float, float]:
    """Wilson's 95% interval of a binomial proportion (``(nan, nan)`` for no trials)."""
    if count <= 0:
        return math.nan, math.nan
    p = hits / count
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * count)) / (1 + z2 / count)
    half = Z95 * math.sqrt(p * (1 - p) / count + z2 / (4 * count * count)) / (1 + z2 / count)
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy_interval(per_seed: Sequence[tuple[int, int]]) -> Interval:
    """Mean accuracy over seeds of ``(hits, count)`` pairs; the interval is the wider of the
    t interval over the seeds' accuracies and Wilson's over the pooled positions."""
    seeds = [(h, n) for h, n in per_seed if n > 0]
    if not seeds:
        return NAN
    accs = [h / n for h, n in seeds]
    hits = sum(h for h, _ in seeds)
    count = sum(n for _, n in seeds)
    low, high = wilson(hits, count)
    seed = mean_interval(accs)
    mean = seed.mean
    data_half = max(mean - low, high - mean)
    if len(seeds) > 1 and seed.half >= data_half:
        # An accuracy lies in [0, 1]; the t interval does not know that.
        return Interval(mean, max(0.0, seed.low), min(1.0, seed.high), seed.n, "seeds")
    return Interval(mean, min(low, mean), max(high, mean), len(seeds), "positions")


def difference_interval(
    first: Sequence[tuple[int, int]], second: Sequence[tuple[int, int]]
) -> Interval:
    """``second - first`` in accuracy, seed by seed (the two lists pair up by seed: the same
    data stream); the interval is the wider of the t interval over the paired differences
    and the normal interval of a difference of two pooled proportions."""
    pairs = [(a, b) for a, b in zip(first, second, strict=True) if a[1] > 0 and b[1] > 0]
    if not pairs:
        return NAN
    diffs = [b[0] / b[1] - a[0] / a[1] for a, b in pairs]
    n1 = sum(a[1] for a, _ in pairs)
    n2 = sum(b[1] for _, b in pairs)
    p1 = sum(a[0] for a, _ in pairs) / n1
    p2 = sum(b[0] for _, b in pairs) / n2
    # At p = 0 or 1 the normal interval vanishes; use a pseudo-count so it never does.
    q1 = (p1 * n1 + 0.5) / (n1 + 1)
    q2 = (p2 * n2 + 0.5) / (n2 + 1)
    data_half = Z95 * math.sqrt(q1 * (1 - q1) / n1 + q2 * (1 - q2) / n2)
    iv = mean_interval(diffs, data_half=data_half)
    # A difference of two accuracies lies in [-1, 1].
    return Interval(iv.mean, max(-1.0, iv.low), min(1.0, iv.high), iv.n, iv.source)


def verdict_above(interval: Interval, threshold: float) -> str:
    """Claim "the value exceeds ``threshold``": yes if the whole interval is above it, no if
    the whole interval is below it, else inconclusive."""
    if math.isnan(interval.mean):
        return "inconclusive"
    if interval.low > threshold:
        return "yes"
    if interval.high < threshold:
        return "no"
    return "inconclusive"


def verdict_below(interval: Interval, threshold: float) -> str:
    """Claim "the value is below ``threshold``" (the mirror of :func:`verdict_above`)."""
    flipped = verdict_above(interval, threshold)
    return {"yes": "no", "no": "yes"}.get(flipped, flipped)


def verdict_within(interval: Interval, margin: float) -> str:
    """Claim "the value lies within ``+-margin``": yes if the whole interval does, no if it
    lies entirely outside, else inconclusive."""
    if math.isnan(interval.mean):
        return "inconclusive"
    if -margin < interval.low and interval.high < margin:
        return "yes"
    if interval.low > margin or interval.high < -margin:
        return "no"
    return "inconclusive"
