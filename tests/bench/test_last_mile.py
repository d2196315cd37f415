"""benchmarks/last_mile.py: the native kernels' targets judged from benchmark CSVs — each
rule at its edges, the misses listed, bad input refused in one line, the committed reports
readable, and ``--run --quick`` through every benchmark it starts."""

from __future__ import annotations

import csv
import importlib.util
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_script():  # type: ignore[no-untyped-def]
    """The repository's ``benchmarks/last_mile.py`` (a script, not a module of the package)."""
    path = ROOT / "benchmarks" / "last_mile.py"
    spec = importlib.util.spec_from_file_location("last_mile", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


last_mile = _load_script()

TRAINING_HEAD = ["B", "n", "K", "causal", "pass", "backend", "auto_backend", "ms", "over_sdpa",
                 "note"]


def _csv(path: Path, head: list[str], rows: list[list[object]]) -> Path:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    writer.writerows(rows)
    path.write_text(buf.getvalue())
    return path


def _training(path: Path, cells: dict[tuple[int, int, int, int, str], tuple[float, float]],
              backend: str = "auto") -> Path:
    rows: list[list[object]] = []
    for (b, n, k, causal, pass_), (ms, ratio) in cells.items():
        rows.append([b, n, "", causal, pass_, "sdpa", "", ms / ratio, 1, ""])
        rows.append([b, n, k, causal, pass_, backend, "native", ms, ratio, ""])
    return _csv(path, TRAINING_HEAD, rows)


def _verdicts(targets: list[last_mile.Target]) -> list[bool | None]:
    return [t.met for t in targets]


def test_the_flop_floor_is_the_reports_own() -> None:
    # the floors the committed reports state beside their cells
    stated = {(64, 16): 1.52, (64, 64): 2.98, (128, 64): 2.01, (256, 64): 1.50,
              (128, 16): 1.26, (512, 64): 1.25, (1024, 64): 1.13}
    for (n, k), floor in stated.items():
        assert last_mile.flop_floor(n, k) == pytest.approx(floor, abs=0.005)


@pytest.mark.parametrize(("n", "k", "ratio", "met"), [
    (512, 16, 1.19, True), (512, 16, 1.21, False),  # K < n/4: 1.2x SDPA
    (64, 64, 3.27, True), (64, 64, 3.29, False),  # K > n/4: 1.1 x floor 2.98 = 3.28
    (256, 64, 1.64, True), (256, 64, 1.66, False),  # K = n/4: either; 1.1 x 1.50 = 1.65
])
def test_float32_cells_against_sdpa_or_the_floor(tmp_path: Path, n: int, k: int, ratio: float,
                                                 met: bool) -> None:
    path = _training(tmp_path / "t.csv", {(4096 // n, n, k, 0, "fwd"): (10.0, ratio),
                                          (4096 // n, n, k, 1, "fwd+bwd"): (30.0, 0.5)})
    fwd, both = last_mile.check_training(path)
    assert (fwd.met, both.met) == (met, True)
    assert len(fwd.cells) == len(both.cells) == 1


def test_only_the_auto_and_native_rows_are_judged(tmp_path: Path) -> None:
    path = _training(tmp_path / "t.csv", {(8, 512, 16, 0, "fwd"): (10.0, 5.0)}, backend="fused")
    with pytest.raises(last_mile.CheckError, match="no rows of the auto or native backends"):
        last_mile.check_training(path)


def test_bfloat16_limits_by_length_and_against_float32(tmp_path: Path) -> None:
    bf16 = _training(tmp_path / "b.csv", {(32, 128, 16, 0, "fwd"): (5.0, 1.39),
                                          (8, 512, 16, 0, "fwd"): (5.0, 1.21)})
    fp32 = _training(tmp_path / "f.csv", {(32, 128, 16, 0, "fwd"): (6.0, 1.0),
                                          (8, 512, 16, 0, "fwd"): (4.0, 1.0)})
    limits, against = last_mile.check_bf16(bf16, fp32, bf16_gemms=True)
    assert limits.met is False and [c[0] for c in limits.misses] == ["8 x 512, K = 16, fwd"]
    assert against.met is False and len(against.misses) == 1  # 5 ms in bf16 against 4 ms
    (_, not_a_target) = last_mile.check_bf16(bf16, fp32, bf16_gemms=False)
    assert not_a_target.met is None and "not a target here" in not_a_target.text


DECODE_HEAD = ["case", "batch", "threads", "relpos", "ct2_f32", "ct2_int8", "agree"]


def test_decoding_limits_by_batch_and_the_tokens_must_agree(tmp_path: Path) -> None:
    path = _csv(tmp_path / "d.csv", DECODE_HEAD, [
        ["decode", 1, 1, 9.9, 10.0, 5, True], ["decode", 8, 1, 7.9, 10.0, 5, True],
        ["forward", 1, 1, 50, 10, 5, ""]])
    (target,) = last_mile.check_decode(path)
    assert target.met is True and len(target.cells) == 2
    path = _csv(tmp_path / "d.csv", DECODE_HEAD, [
        ["decode", 1, 2, 9.0, 10.0, 5, False], ["decode", 8, 2, 8.1, 10.0, 5, True]])
    (target,) = last_mile.check_decode(path)
    assert target.met is False
    assert [c[0] for c in target.misses] == ["batch 8, 2 threads"]
    assert target.problems == ["batch 1, 2 threads: the tokens differ from CTranslate2's"]


ATTENTION_HEAD = ["n", "K", "backend", "fwd_ms", "fwd_ratio", "fwdbwd_ms", "fwdbwd_ratio",
                  "peak_mib", "mem_ratio", "note"]


def test_memory_is_judged_at_its_cell_and_the_report_lists_every_miss(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    attention = _csv(tmp_path / "attention.csv", ATTENTION_HEAD, [
        [8192, 64, "native", 1, 1.0, 1, 1.0, 60, 1.3],  # not the memory cell
        [16384, 64, "native", 1, 1.1, 1, 1.25, 130, 1.12],
        [16384, 64, "sdpa", 1, 1, 1, 1, 116, 1]])
    (tmp_path / "attention.md").write_text("# x\n\n- **hardware**: Some CPU, 2 logical CPUs\n")
    assert last_mile.main(["--attention", str(attention), "--out", str(tmp_path / "t.md")]) == 1
    out = capsys.readouterr().out
    name = f"{tmp_path.name}/attention.csv"  # reports are named with their directory
    assert f"- **{name}**: Some CPU, 2 logical CPUs" in out, out
    assert "| 1 | 1.12x (limit 1.10) at n = 16384, K = 64 | **missed** |" in out, out
    assert f"- n = 16384, K = 64, fwd+bwd: 1.25x, limit 1.20x ({name})" in out, out
    assert f"- n = 16384, K = 64: 1.12x, limit 1.10x ({name})" in out, out
    assert "n = 8192" not in out.split("Missed:")[1]
    assert (tmp_path / "t.md").read_text() in out + "\n"


def test_every_target_met_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _training(tmp_path / "t.csv", {(8, 512, 16, 0, "fwd"): (10.0, 0.9)})
    assert last_mile.main(["--training", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| met |") == 1 and "| not measured |" in out and "Missed" not in out


@pytest.mark.parametrize(("argv", "fragment"), [
    ([], "nothing to check"),
    (["--run", "DIR", "--training", "x.csv"], "--run DIR measures its own reports"),
    (["--quick"], "--quick goes with --run DIR"),
    (["--training", "MISSING"], "--training {MISSING}: No such file or directory"),
    (["--training", "DECODE"], "not the CSV of that report (needs the columns B, n, K"),
    (["--decode", "BADNUM"], "column batch holds 'one', not a number"),
    (["--run", "FILE"], "--run {FILE}: that is a file, not a directory"),
])
def test_bad_input_is_refused_in_one_line(argv: list[str], fragment: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    files = {"DECODE": _csv(tmp_path / "d.csv", DECODE_HEAD, [["decode", 1, 1, 1, 1, 1, True]]),
             "BADNUM": _csv(tmp_path / "b.csv", DECODE_HEAD, [["decode", "one", 1, 1, 1, 1,
                                                               True]]),
             "FILE": tmp_path / "FILE", "MISSING": tmp_path / "MISSING"}
    files["FILE"].write_text("")
    argv = [str(files[a]) if a in files else a for a in argv]
    try:
        code = last_mile.main(argv)
        usage = False
    except SystemExit as exit_:  # argparse's refusals: the usage, then the one error line
        code, usage = exit_.code, True  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert fragment.format(**files) in err[-1], err
    assert usage or (len(err) == 1 and err[0].startswith("relpos: error: ")), err


REPORTS = {"--training": ["training_shapes_xeon.csv", "training_shapes_epyc.csv"],
           "--bf16": ["training_shapes_xeon_bf16.csv", "training_shapes_epyc_bf16.csv"],
           "--attention": ["attention_epyc.csv", "attention_xeon.csv"],
           "--decode": ["ct2_decode_xeon.csv", "ct2_decode_epyc.csv"]}


@pytest.mark.parametrize(("option", "name"), [(o, n) for o, ns in REPORTS.items() for n in ns])
def test_the_committed_reports_are_read(option: str, name: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Every committed report the targets are read from parses, with cells to judge, and its
    machine is named (whatever the verdicts)."""
    code = last_mile.main([option, str(ROOT / "benchmarks" / name), "--bf16-gemms", "yes"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert f"- **benchmarks/{name}**: " in out and "not said" not in out, out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "| target |" not in r]
    assert rows and all(int(r.split(" | ")[2]) > 0 for r in rows if "| not measured |" not in r
                        ), out


def test_run_quick_measures_every_report_and_checks_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--run DIR --quick``: each benchmark runs (tiny shapes), writes where the checks read,
    and the table says so (verdicts on such shapes mean nothing: not asserted)."""
    pytest.importorskip("ctranslate2")
    for name in last_mile.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELPOS_DECODE_PACKING", "none")  # a setting the header must record
    out_dir = tmp_path / "lm"
    code = last_mile.main(["--run", str(out_dir), "--quick"])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    assert "A --quick run" in out and (out_dir / "targets.md").read_text() in out + "\n"
    assert "- **settings**: RELPOS_DECODE_PACKING=none (of RELPOS_NATIVE, " in out, out
    for name in ("fp32/training.csv", "bf16/training.csv", "long/attention.csv",
                 "held/attention.csv", "held_causal/attention.csv", "lm/ct2_decode.csv"):
        assert f"- **{name}**: " in out and "not said" not in out, (name, out)
    table = [r for r in out.splitlines() if r.startswith("| ") and "| target |" not in r]
    assert len(table) == 7
    counts = {r.split(" | ")[0][2:]: r.split(" | ")[2] for r in table}
    assert counts["peak memory of forward + backward at n = 16384, K = 64 <= 1.1x SDPA's"] \
        == "0"  # --quick skips the memory subprocesses
    assert all(c != "0" for t, c in counts.items() if not t.startswith("peak memory"))


def test_decoding_on_the_panels_where_they_are_not_the_default_is_an_alternative(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run with RELPOS_DECODE_PACKING=relpos on a CPU whose default is another packing is
    judged and shown, but a miss there does not fail the check."""
    default = _csv(tmp_path / "d.csv", DECODE_HEAD, [["decode", 1, 1, 9.0, 10.0, 5, True]])
    panels = _csv(tmp_path / "p.csv", DECODE_HEAD, [["decode", 1, 1, 11.0, 10.0, 5, True]])
    (target,) = last_mile.check_decode(panels, "--decode-panels")
    assert target.alternative and target.met is False
    assert target.text.startswith("with RELPOS_DECODE_PACKING=relpos (not this CPU's default)")
    assert last_mile.main(["--decode", str(default), "--decode-panels", str(panels)]) == 0
    out = capsys.readouterr().out
    assert "| **missed** (an alternative: not in the exit status) |" in out, out
    assert last_mile.main(["--decode-panels", str(default)]) == 0
    assert "| met (an alternative: not in the exit status) |" in capsys.readouterr().out


@pytest.mark.parametrize(("asked", "default", "vectors", "alternative"), [
    ("", "mkl", "avx512", True),  # Intel: MKL by default, panels built with their vectors
    ("", "mkl", "avx2", True),
    ("", "mkl", "none", False),  # plain-loop panels: not worth timing
    ("", "relpos", "avx512", False),  # already the default: the decode run times them
    ("mkl", "mkl", "avx512", False),  # a packing asked for: the run keeps to it
])
def test_run_times_the_panels_too_only_where_they_are_a_real_alternative(
        asked: str, default: str, vectors: str, alternative: bool,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    from relpos.models import decoding
    from relpos.ops.native import build

    if asked:
        monkeypatch.setenv("RELPOS_DECODE_PACKING", asked)
    else:
        monkeypatch.delenv("RELPOS_DECODE_PACKING", raising=False)
    monkeypatch.setattr(decoding, "decode_packing", lambda: default)
    kernels = object()  # a stand-in for the loaded kernels, whose build_info says `vectors`
    monkeypatch.setattr(build, "load", lambda quiet=False: kernels)
    monkeypatch.setattr(build, "build_facts",
                        lambda module: {"vectors": vectors} if module is kernels else {})
    assert last_mile.panels_are_an_alternative() is alternative
    commands = {name: (argv, env) for name, argv, env in last_mile.run_commands(tmp_path)}
    assert ("decode on the panels" in commands) is alternative
    if alternative:
        argv, env = commands["decode on the panels"]
        assert env == {"RELPOS_DECODE_PACKING": "relpos"}
        assert argv[-1] == str(tmp_path / "ct2_decode_panels.md")
        assert argv[:-1] == commands["decode"][0][:-1]  # the same benchmark otherwise
    assert commands["decode"][1] == {}
