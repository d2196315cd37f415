"""What would settle an inconclusive claim (relpos.training.experiment.seeds): its
half-width, and the seeds or positions that would decide it."""

from __future__ import annotations

from relpos.training.experiment.claims import NOT_LEARNED
from relpos.training.experiment.seeds import to_settle
from relpos.training.experiment.stats import Interval, t_quantile


def test_what_would_settle_an_inconclusive_claim():
    def row(iv, kind="above", unit="pp", thr=0.02, verdict="inconclusive"):
        return {"verdict": verdict, "interval": iv, "kind": kind, "unit": unit,
                "threshold": thr}

    # Seeds set the interval: sd = half * sqrt(n) / t(n - 1); the advice is the fewest
    # seeds whose interval at that sd no longer reaches the threshold.
    n, half = 6, 0.04
    sd = half * n ** 0.5 / t_quantile(n - 1)
    said = to_settle(row(Interval(0.05, 0.05 - half, 0.05 + half, n, "seeds")))
    need = next(m for m in range(2, 200) if t_quantile(m - 1) * sd / m ** 0.5 < 0.03)
    assert f"about {need} seeds" in said and "within ±5.0 pp" in said
    wide = to_settle(row(Interval(0.05, -0.05, 0.15, n, "seeds")))
    assert "wider than ±5.0 pp" in wide
    # Positions set it: (half / distance to the threshold)^2 as many.
    said = to_settle(row(Interval(0.04, 0.0, 0.08, n, "positions")))
    assert "about 4.0x as many" in said
    # A mean on the threshold cannot be decided; "within" measures |mean| against it.
    assert "no number of runs" in to_settle(row(Interval(0.02, 0.0, 0.04, n)))
    assert "no number of runs" in to_settle(
        row(Interval(-0.02, -0.04, 0.0, n), kind="within"))
    bits = to_settle(row(Interval(0.01, -0.02, 0.04, n), kind="within", unit="bits"))
    assert "half-width 0.030 (wider than ±0.020)" in bits
    assert "until the subset is learned" in to_settle(row(None, verdict=NOT_LEARNED))
    assert "K=8 or a larger K" in to_settle(
        {"verdict": "inconclusive", "reference": "K=64", "enough": 16, "short": 4})
    # The range claim names what each undecided K between the two would take.
    gap = Interval(0.017, 0.017 - half / 5, 0.017 + half / 5, n, "seeds")
    said = to_settle({"verdict": "inconclusive", "reference": "K=128", "enough": 16,
                       "short": 4, "undecided": [("K=8", gap)], "threshold": 0.02,
                       "unit": "bits"})
    sd = half / 5 * n ** 0.5 / t_quantile(n - 1)
    need = next(m for m in range(2, 200) if t_quantile(m - 1) * sd / m ** 0.5 < 0.003)
    assert "K=8 shown either way: half-width 0.008 (within ±0.020)" in said
    assert f"about {need} seeds" in said
