"""The claims and their verdicts (relpos.training.experiment.claims), on results documents
built by hand."""

from __future__ import annotations

from relpos.training.experiment import claims, make_report
from relpos.training.experiment.claims import undecided_ks
from relpos.training.experiment.stats import Interval


def _verdict(results: dict, claim: str) -> str:
    return next(r["verdict"] for r in claims(results) if r["claim"].startswith(claim))


def test_verdicts_follow_the_intervals(synthetic):
    clear = synthetic({4: (1.0, 0.2), 8: (1.0, 0.5), 16: (1.0, 0.9), 32: (1.0, 0.9),
                        64: (1.0, 0.9)})
    assert _verdict(clear, "K=4 vs K=16") == "yes"
    assert _verdict(clear, "K=16 suffices") == "yes"
    assert _verdict(clear, "K=32 vs K=64") == "yes"
    assert _verdict(clear, "typical K") == "yes"  # K=8 shown short, K=16 shown enough
    flat = synthetic({4: (1.0, 0.9), 16: (1.0, 0.9), 32: (1.0, 0.6), 64: (1.0, 0.9)})
    assert _verdict(flat, "K=4 vs K=16") == "no"
    assert _verdict(flat, "K=32 vs K=64") == "no"
    assert _verdict(flat, "typical K") == "no"  # K=4 is already enough
    # A 2-point gap with 3 seeds and 400 positions cannot be told from 2 pp: inconclusive.
    close = synthetic({4: (1.0, 0.88), 16: (1.0, 0.90), 32: (1.0, 0.89), 64: (1.0, 0.90)})
    assert _verdict(close, "K=4 vs K=16") == "inconclusive"
    report = make_report(clear)
    assert "Test CPU" in report and "| inconclusive |" not in report.split("## Synthetic")[0]


def test_the_range_claim_names_the_k_it_waits_on():
    def iv(mean, half):
        return Interval(mean, mean - half, mean + half, 5, "seeds")

    gaps = {4: ("K=4", iv(0.05, 0.01)), 8: ("K=8", iv(0.02, 0.01)),
            16: ("K=16", iv(0.01, 0.02)), 32: ("K=32", iv(0.0, 0.01)),
            64: ("K=64", iv(0.0, 0.0))}
    # K=8 decides the claim either way: only it is named.
    assert [lab for lab, _ in undecided_ks(gaps, 32, 4, 0.02)] == ["K=8"]
    # Without an open K=8, every open K between the largest short and the smallest enough.
    assert [lab for lab, _ in undecided_ks(gaps, 32, 8, 0.02)] == ["K=16"]
    assert [lab for lab, _ in undecided_ks(gaps, None, None, 0.02)] == ["K=8"]
    gaps[8] = ("K=8", iv(0.05, 0.01))
    assert [lab for lab, _ in undecided_ks(gaps, None, 8, 0.02)] == ["K=16"]
    assert undecided_ks(gaps, 16, 8, 0.02) == []
