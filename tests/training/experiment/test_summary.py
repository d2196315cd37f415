"""What ``relpos experiment`` prints at the end: a short summary (each claim's verdicts on a
line, which K to choose, where the report and figures are), not the report."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from relpos.training.experiment import load_results, run_experiment
from relpos.training.experiment.claims import claims, signal_claims
from relpos.training.experiment.report import make_summary


def test_a_sweep_prints_its_summary_not_its_report(tmp_path, tiny, capsys):
    out = tmp_path / "e"
    results = run_experiment(replace(tiny, seeds=(0,)), out, progress=False)
    printed = capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert len(report.splitlines()) > 60
    lines = printed.splitlines()
    assert len(lines) < 20, printed
    assert "##" not in printed and "|---" not in printed  # no heading, no table of the report
    assert lines[0].startswith(f"relpos experiment: {len(results['runs'])} runs, 1 seed(s) (0)")
    # One line per claim, numbered as in the report, with its verdicts.
    rows = claims(results) + signal_claims(results)
    order = list(dict.fromkeys(r["claim"] for r in rows))
    assert order, "the tiny sweep judges no claim: the test would check nothing"
    assert "Shaw et al., 2018" in printed
    for number, claim in enumerate(order, 1):
        line = next(x for x in lines if x.startswith(f"  {number}. {claim}: "))
        assert f"### {number}. {claim}" in report
        verdicts = {r["verdict"] for r in rows if r["claim"] == claim}
        for verdict in verdicts:
            word = "Inconclusive" if verdict.startswith("inconclusive") else verdict.upper()
            assert f"{word} on " in line, line
    # Which K, per task and depth the report's table has.
    assert "Which K to choose" in printed
    assert any(x.startswith("  recall, depth 1 (reference K=4): ") for x in lines), printed
    # Where the report and every figure are.
    assert f"Report: {out / 'report.md'}" in lines
    figures = sorted(p.name for p in out.glob("*.png"))
    assert figures
    where = next(x for x in lines if x.startswith("Figures in "))
    assert where.startswith(f"Figures in {out}: ")
    assert sorted(where.split(": ", 1)[1].split(", ")) == figures
    assert load_results(out)["runs"] == results["runs"]


def test_the_summary_groups_k_choices_and_marks_unlearned_ranges(synthetic):
    # K=8 is enough up to d=4, only K=64 (the reference) beyond; nothing is learned at all in
    # the second document.
    results = synthetic({0: (0.1, 0.1), 8: (0.95, 0.2), 64: (0.95, 0.95)})
    text = make_summary(results, Path("out/report.md"), [Path("out/a.png"), Path("out/b.png")])
    assert "  recall, depth 1 (reference K=64): K=8 for d=2; K=64 for d=12-24" in text
    assert text.splitlines()[-2:] == ["Report: out/report.md", "Figures in out: a.png, b.png"]
    flat = synthetic({0: (0.01, 0.01), 64: (0.02, 0.02)})
    assert "(reference K=64): not learned for d=2-24" in make_summary(flat, Path("r.md"))
