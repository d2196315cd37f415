"""The figures of the committed studies (relpos.training.experiment.figures), drawn from their
results documents: heatmap colour bars in % like the cells, the d = K marks outlined, a
bracket column without a scored closer left out (and said), the bits-per-character plot's
baselines as drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relpos.training.experiment import load_results, write_figures

ROOT = Path(__file__).resolve().parents[3]

pytest.importorskip("matplotlib")


def _figures(study: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The figures ``write_figures`` draws for the committed ``study``, by file name."""
    import relpos.training.plotting

    drawn: dict[str, Any] = {}

    def keep(fig: Any, path: Path, **_: Any) -> Path:
        drawn[Path(path).name] = fig
        return Path(path)

    monkeypatch.setattr(relpos.training.plotting, "save_figure", keep)
    write_figures(load_results(ROOT / "benchmarks" / study), tmp_path)
    return drawn


def _ticks(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


def test_heatmaps_speak_percent_and_mark_d_equals_k(tmp_path, monkeypatch):
    figs = _figures("experiment", tmp_path, monkeypatch)
    for name in ("heatmap_recall.png", "heatmap_agree.png", "heatmap_pysrc.png"):
        fig = figs[name]
        *panels, bar = fig.axes
        assert "%" in bar.get_ylabel()
        assert bar.yaxis.get_major_formatter()(0.25, 0) == "25"
        assert bar.yaxis.get_major_formatter()(0.125, 0) == "12.5"
        for ax in panels:
            cells = [t.get_text() for t in ax.texts]
            assert cells and all(c.isdigit() for c in cells)  # percent, like the colour bar
            marks = [line for line in ax.get_lines() if line.get_path_effects()]
            assert marks, name
            for line in marks:  # white, outlined in black: seen on every colour of the map
                assert line.get_color() == "white"
                assert any(getattr(e, "_gc", {}).get("foreground") == "black"
                           for e in line.get_path_effects())
    # recall: K=2..32 have a distance >= K beyond the first column (d = 1): 5 marks a panel.
    for ax in figs["heatmap_recall.png"].axes[:-1]:
        assert len([x for x in ax.get_lines() if x.get_path_effects()]) == 5


def test_a_bracket_column_without_a_closer_is_left_out_and_said(tmp_path, monkeypatch):
    fig = _figures("experiment", tmp_path, monkeypatch)["heatmap_pysrc.png"]
    short, long = fig.axes[:2]
    assert _ticks(short) == ["1-4", "5-16", "17-32", "33-64", "65-128"]
    assert "left out" not in short.get_xlabel()
    # At length 1024 no closer had its opener 513 or more back: no column, and the axis says so.
    assert _ticks(long) == ["1-4", "5-16", "17-32", "33-64", "65-128", "129-512"]
    assert "513-2048 left out: no closer scored" in long.get_xlabel()


@pytest.mark.parametrize(("study", "baselines"), [("experiment", ["learned", "sinusoidal"]),
                                                  ("experiment-long", [])])
def test_bpc_plot_draws_the_baselines_its_label_names(tmp_path, monkeypatch, study, baselines):
    ax = _figures(study, tmp_path, monkeypatch)["bpc_pysrc.png"].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    named = [b for b in ("learned", "sinusoidal") if any(t.startswith(b) for t in legend)]
    assert named == baselines
    horizontal = [line for line in ax.get_lines()
                  if len(set(line.get_ydata())) == 1 and len(line.get_ydata()) == 2]
    # A horizontal line per baseline and evaluation length (3 lengths).
    assert len(horizontal) == 3 * len(baselines)
    if baselines:
        assert {line.get_linestyle() for line in horizontal} == {"--", ":"}
        assert "baselines" in ax.get_xlabel()
    else:
        assert ax.get_xlabel() == "clip distance K"


@pytest.mark.parametrize("study", ["experiment", "experiment-long"])
def test_every_mark_of_a_heatmap_is_in_its_legend(tmp_path, monkeypatch, study):
    figs = _figures(study, tmp_path, monkeypatch)
    for name in [n for n in figs if n.startswith("heatmap_")]:
        (legend,) = figs[name].legends
        (mark,) = legend.legend_handles
        assert mark.get_color() == "white" and mark.get_path_effects(), name
        assert "white bar outlined in black: d = K" in legend.get_texts()[0].get_text()


@pytest.mark.parametrize("study", ["experiment", "experiment-long"])
def test_extrapolation_plots_draw_no_band_over_another_and_name_every_line(
        tmp_path, monkeypatch, study):
    """Each model's interval is a bar beside its point (a filled band per model washed ten
    models into one block); the legend names every model and the dotted chance line."""
    from matplotlib.collections import PolyCollection
    from matplotlib.container import ErrorbarContainer

    figs = _figures(study, tmp_path, monkeypatch)
    names = [n for n in figs if n.startswith("extrapolation_")]
    assert names
    for name in names:
        for ax in figs[name].axes:
            assert not [c for c in ax.collections if isinstance(c, PolyCollection)], name
            bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
            assert len(bars) >= 5, name
            lengths = len(ax.get_xticks())
            assert all(len(b.lines[0].get_xdata()) == lengths for b in bars)
            # The models of one length sit side by side, none on another's place.
            firsts = [b.lines[0].get_xdata()[0] for b in bars]
            assert len(set(firsts)) == len(firsts)
        legend = [t.get_text() for ax in figs[name].axes if ax.get_legend()
                  for t in ax.get_legend().get_texts()]
        models = {b.get_label() for ax in figs[name].axes for b in ax.containers}
        assert models <= set(legend), (name, models - set(legend))
        if not name.endswith("pysrc.png"):  # accuracy: chance drawn, and in the legend
            assert "chance" in legend
