"""Intervals and verdicts of the K sweep, on constructed numbers."""

from __future__ import annotations

import math

import pytest

from relpos.training.experiment.stats import (
    Interval,
    accuracy_interval,
    difference_interval,
    mean_interval,
    t_quantile,
    verdict_above,
    verdict_below,
    verdict_within,
    wilson,
)


def test_t_quantiles_and_wilson():
    assert t_quantile(2) == pytest.approx(4.303)
    assert t_quantile(1000) == pytest.approx(1.96, abs=1e-3)
    with pytest.raises(ValueError):
        t_quantile(0)
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-3) and high == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    assert all(math.isnan(x) for x in wilson(0, 0))


@pytest.mark.parametrize("per_seed", [[(90, 100), (80, 100), (85, 100)],
                                      [(1, 10), (9, 10), (5, 10)], [(10, 10)], [(0, 7), (0, 9)]])
def test_intervals_contain_the_mean(per_seed):
    iv = accuracy_interval(per_seed)
    assert iv.low <= iv.mean <= iv.high
    assert iv.mean == pytest.approx(sum(h / n for h, n in per_seed) / len(per_seed))


def test_the_wider_interval_wins():
    # Seeds agree exactly: the interval comes from the positions (Wilson), never zero width.
    iv = accuracy_interval([(80, 100)] * 3)
    assert iv.source == "positions" and iv.high - iv.low > 0.08
    # Seeds disagree a lot on many positions: the t interval over seeds is wider.
    iv = accuracy_interval([(5000, 10000), (7000, 10000), (6000, 10000)])
    assert iv.source == "seeds" and iv.half == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    # Clipped to [0, 1]: an accuracy cannot leave it.
    iv = accuracy_interval([(9000, 10000), (5000, 10000), (9900, 10000)])
    assert iv.source == "seeds" and iv.high == 1.0 and iv.low > 0
    one = mean_interval([0.5])
    assert one.low == -math.inf and one.high == math.inf


def test_paired_difference():
    iv = difference_interval([(50, 100)] * 3, [(90, 100)] * 3)
    assert iv.mean == pytest.approx(0.4) and iv.low > 0.25
    iv = difference_interval([(50, 100), (60, 100)], [(60, 100), (50, 100)])
    assert iv.low < 0 < iv.high
    iv = difference_interval([(0, 100), (100, 100)], [(100, 100), (0, 100)])
    assert iv.low == -1.0 and iv.high == 1.0 and iv.mean == 0.0


def test_verdicts_need_the_interval_on_one_side():
    def iv(low, high):
        return Interval((low + high) / 2, low, high, 3)

    assert verdict_above(iv(0.03, 0.10), 0.02) == "yes"
    assert verdict_above(iv(-0.05, 0.01), 0.02) == "no"
    assert verdict_above(iv(0.01, 0.10), 0.02) == "inconclusive"
    assert verdict_below(iv(-0.05, 0.01), 0.02) == "yes"
    assert verdict_below(iv(0.03, 0.10), 0.02) == "no"
    assert verdict_within(iv(-0.01, 0.015), 0.02) == "yes"
    assert verdict_within(iv(0.03, 0.05), 0.02) == "no"
    assert verdict_within(iv(-0.05, -0.03), 0.02) == "no"
    assert verdict_within(iv(0.0, 0.05), 0.02) == "inconclusive"
    assert verdict_above(Interval(math.nan, math.nan, math.nan, 0), 0.0) == "inconclusive"
