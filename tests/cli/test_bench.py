"""relpos bench --preset training / encoder and --omp-wait-policy from the command line, at
tiny sizes: the reports they write, the options they refuse (one line on stderr, exit 2,
before any timing), the rerun in a subprocess."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relpos.cli import main

TINY = ["--repeats", "1", "--warmup", "0", "--threads", "1"]


def _header(report: str) -> None:
    """The hardware header every report carries."""
    for key in ("date", "command", "hardware", "ISA", "torch", "threads", "OMP_WAIT_POLICY"):
        assert f"- **{key}**: " in report, key


def test_training_preset_writes_its_report(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    status = main(["bench", "--preset", "training", "--tokens", "640", "--lengths", "16,640",
                   "--max-distances", "2", "--heads", "1", "--head-dim", "8", *TINY,
                   "--out", str(tmp_path)])
    assert status == 0
    printed = capsys.readouterr().out
    report = (tmp_path / "training.md").read_text()
    _header(report)
    assert "- **OMP_WAIT_POLICY**: PASSIVE" in report
    assert "--preset training --tokens 640 --lengths 16,640" in report
    head = ("| B x n | causal | pass | auto | native | flash_regions | bucketed | reference | "
            "SDPA ms | auto picks | fastest | auto within 10% of fastest |")
    assert head in report and head in printed and "### K = 2" in report
    rows = [line for line in report.splitlines() if line.startswith(("| 40 x 16", "| 1 x 640"))]
    assert len(rows) == 2 * 2 * 2  # shapes x causal x passes
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] in ("yes", "no") and cells[2] in ("fwd", "fwd+bwd")
        # auto picks the native kernels wherever they serve a call: every call here
        assert cells[9] == "native"
        for cell in cells[3:7]:  # auto, native, flash_regions, bucketed ran: "ms (ratio x)"
            assert cell.endswith("x)") and " ms (" in cell
        if cells[0] == "1 x 640":
            assert cells[7].startswith("skipped: n > 512")  # the reference, with its reason
            assert cells[10] in ("native", "flash_regions", "bucketed")
        else:
            assert cells[7].endswith("x)")
            assert cells[10] in ("native", "flash_regions", "bucketed", "reference")
        assert cells[11].startswith(("yes (", "no ("))
    csv = (tmp_path / "training.csv").read_text().splitlines()
    assert csv[0] == "B,n,K,causal,pass,backend,auto_backend,ms,over_sdpa,note"
    assert len(csv) - 1 == 2 * 2 * (1 + 5) * 2  # shapes x causal x (SDPA + backends) x passes
    assert sum("skipped: n > 512" in line for line in csv) == 2 * 2


def test_encoder_preset_writes_its_report(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    status = main(["bench", "--preset", "encoder", "--tokens", "16", "--lengths", "8",
                   "--backends", "auto,flash_regions", *TINY, "--out", str(tmp_path)])
    assert status == 0
    captured = capsys.readouterr()
    assert "OMP_WAIT_POLICY is unset" in captured.err
    report = (tmp_path / "encoder.md").read_text()
    _header(report)
    assert "- **OMP_WAIT_POLICY**: unset" in report
    assert "E=512, H=8, FF=2048" in report and "norm_first=True" in report
    head = ("| B x n | pass | nn.TransformerEncoderLayer | relpos K=16 auto | "
            "relpos K=16 flash_regions | auto picks |")
    assert head in report and head in captured.out
    # auto runs the native kernels
    assert "| 2 x 8 | fwd+bwd |" in report and "K=16: native" in report
    csv = (tmp_path / "encoder.csv").read_text().splitlines()
    assert csv[0].startswith("B,n,K,model,implementation,attention_backend,pass,ms,over_torch")
    assert len(csv) - 1 == 3 * 2  # (torch, auto, flash_regions) x passes


def test_an_old_backend_name_runs_under_its_new_name_with_a_warning(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-m", "relpos", "bench", "--lengths", "33", "--max-distances", "2",
         "--heads", "1", "--head-dim", "8", *TINY, "--no-memory", "--backends", "fused,sdpa",
         "--out", str(tmp_path)], capture_output=True, text=True, env=env, check=True)
    assert ("DeprecationWarning: --backends fused: deprecated; use flash_regions (the same "
            "backend, renamed)") in done.stderr
    report = (tmp_path / "attention.md").read_text()
    assert "--backends flash_regions,sdpa" in report and "| fused" not in report


def test_command_argv_parses_back_to_the_same_options() -> None:
    from relpos.cli import build_parser
    from relpos.cli.bench import command_argv

    parser = build_parser()
    argv = ["bench", "--preset", "training", "--tokens", "1024", "--lengths", "64,128",
            "--max-distances", "0,16", "--causal", "--no-memory", "--memory-budget", "1.5",
            "--omp-wait-policy", "passive", "--out", "x"]
    args = parser.parse_args(argv)
    again = parser.parse_args(command_argv(args))
    assert vars(again) == vars(args)
    assert command_argv(parser.parse_args(["bench"])) == ["bench"]


def test_omp_wait_policy_reruns_in_a_subprocess(tmp_path, capfd, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    status = main(["bench", "--decode", "--lengths", "16", "--steps", "1", "--max-distances",
                   "2", "--heads", "1", "--head-dim", "8", *TINY, "--backends", "bucketed",
                   "--omp-wait-policy", "passive", "--out", str(tmp_path)])
    assert status == 0
    err = capfd.readouterr().err
    assert "subprocess with OMP_WAIT_POLICY=PASSIVE" in err
    assert "is unset" not in err  # neither this process nor the rerun warns
    report = (tmp_path / "decode.md").read_text()
    _header(report)
    assert "- **OMP_WAIT_POLICY**: PASSIVE" in report  # the subprocess saw it
    assert "--omp-wait-policy passive" in report


def test_omp_wait_policy_already_set_runs_here(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import relpos.bench.hardware
    import relpos.bench.presets

    def no_subprocess(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("reran in a subprocess")

    monkeypatch.setattr(relpos.bench.hardware, "rerun_with_policy", no_subprocess)
    monkeypatch.setattr(relpos.bench.presets, "run_training", lambda args: 0)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert main(["bench", "--preset", "training", "--omp-wait-policy", "passive"]) == 0
    assert capsys.readouterr().err == ""


def _file(tmp: Path) -> Path:
    (tmp / "afile").write_text("not a directory\n")
    return tmp / "afile"


BAD: list[tuple[list[str], str]] = [
    (["--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
    (["--preset", "training", "--decode"], "--preset training and --decode are different"),
    (["--preset", "training", "--batch", "2"], "--batch does not apply to --preset training"),
    (["--preset", "encoder", "--heads", "2"], "--heads does not apply to --preset encoder"),
    (["--preset", "encoder", "--head-dim", "32"], "--head-dim does not apply to --preset"),
    (["--preset", "encoder", "--causal"], "--causal does not apply to --preset encoder"),
    (["--tokens", "4096"], "--tokens applies to relpos bench --preset"),
    (["--preset", "training", "--tokens", "0"], "argument --tokens: must be an int >= 1"),
    (["--preset", "training", "--tokens", "32"], "the default lengths start at n = 64"),
    (["--preset", "training", "--lengths", "8192"], "n = 8192 does not fit"),
    (["--preset", "encoder", "--tokens", "256", "--lengths", "512"], "n = 512 does not fit"),
    (["--preset", "training", "--backends", "sdpa"], "--backends: unknown ['sdpa']"),
    (["--preset", "encoder", "--backends", "auto,decode"], "--backends: unknown ['decode']"),
    (["--preset", "training", "--memory-budget", "0"], "argument --memory-budget"),
    (["--preset", "training", "--out", "{file}"], "is a file; allowed: a directory"),
    (["--omp-wait-policy", "lazy"], "argument --omp-wait-policy: invalid choice: 'lazy'"),
    (["--preset", "encoder", "--omp-wait-policy", "passive", "--heads", "4"],
     "--heads does not apply"),
    (["--backends", "nope", "--omp-wait-policy", "active"], "unknown ['nope']"),
]


@pytest.mark.parametrize(("argv", "fragment"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, fragment, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import relpos.bench.attention
    import relpos.bench.decode
    import relpos.bench.encoder
    import relpos.bench.hardware
    import relpos.bench.presets

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("reached the benchmark")

    for module, name in [(relpos.bench.attention, "run_attention"),
                         (relpos.bench.decode, "run_decode"),
                         (relpos.bench.presets, "run_training"),
                         (relpos.bench.encoder, "run_encoder"),
                         (relpos.bench.hardware, "rerun_with_policy")]:
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # the warning must not come first
    argv = [a.replace("{file}", str(_file(tmp_path))) for a in argv]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main(["bench", *argv])
    assert status == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relpos: error: "), lines
    assert fragment in lines[0]


def test_help_names_the_presets(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "--preset {training,encoder}" in text and "--omp-wait-policy {passive,active}" in text
    assert "--tokens" in text


def test_help_is_plain_text_in_every_subcommand(capsys) -> None:  # type: ignore[no-untyped-def]
    """Docstring markup (double backticks, :role:`x`) does not reach --help."""
    from relpos.cli import SUBCOMMANDS

    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit):
            main([name.replace("_", "-"), "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and ":mod:" not in text and ":func:" not in text, name


def test_the_attention_plot_keeps_its_legend_off_the_lines(tmp_path) -> None:
    """The legend of ``attention.png`` sits outside every panel, so it covers no line (sdpa,
    the reference, runs where a legend inside would go), and lists each backend once."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from relpos.bench.attention import Result, _figure, _plot

    results = [Result(n=n, K=K, backend=b, fwdbwd_ms=t * n / 512)
               for K in (16, 64) for b, t in (("flash_regions", 50.0), ("sdpa", 20.0))
               for n in (512, 1024, 2048)]
    fig = _figure(results)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["flash_regions", "sdpa"]
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
        assert ax.get_legend() is None
    path = _plot(results, tmp_path / "attention.png")
    assert path is not None and path.read_bytes().startswith(b"\x89PNG")
