"""The benchmark harness (relpos.bench) at tiny sizes: it runs, writes its reports, and the
old entry points still work. Benchmarks are not tests: nothing here checks a speed."""

from __future__ import annotations

import pytest

from relpos.bench import common
from relpos.cli import main


def test_interleaved_medians_rounds_and_failures() -> None:
    calls: list[str] = []

    def ok(name: str):  # type: ignore[no-untyped-def]
        return lambda: calls.append(name)

    def boom() -> None:
        raise RuntimeError("no kernel\nfor this")

    ticks: list[tuple[str, int]] = []
    medians, failures = common.interleaved_medians(
        {"a": [ok("a1"), ok("a2")], "b": [boom], "c": [ok("c")]},
        warmup=1, repeats=2, tick=lambda case, r: ticks.append((case, r)),
        errors=(RuntimeError,),
    )
    assert calls == ["a1", "a2", "c"] * 3  # interleaved: one call of each case per round
    assert set(medians) == {"a", "c"} and len(medians["a"]) == 2 and len(medians["c"]) == 1
    assert failures == {"b": "no kernel"}
    assert ticks == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2), ("c", 2)]
    with pytest.raises(RuntimeError):
        common.interleaved_medians({"b": [boom]}, warmup=0, repeats=1)


def test_interleaved_medians_rotate() -> None:
    calls: list[str] = []
    cases = {name: [lambda name=name: calls.append(name)] for name in "abc"}
    medians, _ = common.interleaved_medians(cases, warmup=1, repeats=3, rotate=True)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert set(medians) == set("abc")
    assert common.interleaved_medians({}, warmup=1, repeats=1, rotate=True) == ({}, {})


def test_format_ms() -> None:
    assert [common.format_ms(v) for v in (1234.4, 12.34, 1.234, 0.1234)] == [
        "1234", "12.3", "1.23", "0.123"]


def test_report_helpers() -> None:
    assert common.markdown_table(["a", "b"], [["1", "2"]], align="---:") == [
        "| a | b |", "|---:|---:|", "| 1 | 2 |"]
    assert common.csv_text(["a", "b"], [[1, ""]]) == "a,b\n1,\n"
    assert common.markdown_meta({"command": "relpos bench", "torch": "2"}) == [
        "- **command**: `relpos bench`", "- **torch**: 2"]
    with pytest.raises(ValueError, match="unknown"):
        common.check_names("--backends", "flash_regions,nope", ("flash_regions", "sdpa"))


def test_settings_and_report_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert common.check_dtype(None) == "float32" and common.check_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="--dtype must be one of"):
        common.check_dtype("float16")
    with pytest.raises(ValueError, match="--threads must be positive"):
        common.use_threads(0)
    assert common.report_files(tmp_path, "training") == [tmp_path / "training.md",
                                                         tmp_path / "training.csv"]
    assert common.report_files(tmp_path, "attention")[-1] == tmp_path / "attention.png"
    # only a report written as files (--decode) takes a file name: else it is a directory
    assert common.report_files(tmp_path / "x.csv", "decode", file_ok=True) == [
        tmp_path / "x.md", tmp_path / "x.csv"]
    assert common.report_files(tmp_path / "x.md", "decode") == [
        tmp_path / "x.md" / "decode.md", tmp_path / "x.md" / "decode.csv"]
    meta = common.RunClock().meta()
    assert meta["load"].startswith("1-min load average ") and meta["duration"] == "0.0 min"


def test_decode_bench_cli_writes_report(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    status = main([
        "bench", "--decode", "--lengths", "16", "--steps", "1,4", "--max-distances", "2",
        "--heads", "1", "--head-dim", "8", "--repeats", "1", "--warmup", "0",
        "--backends", "bucketed", "--out", str(tmp_path),
    ])
    assert status == 0
    out = capsys.readouterr().out
    assert "relpos/sdpa" in out and "bucketed/sdpa" in out
    report = (tmp_path / "decode.md").read_text()
    assert "relpos bench --decode" in report and "**torch**" in report
    rows = (tmp_path / "decode.csv").read_text().splitlines()
    assert rows[0].startswith("K,t,S,auto_backend,sdpa_ms,relpos_ms,bucketed_ms")
    assert [r.split(",")[:4] for r in rows[1:]] == [["2", "1", "16", "native"],
                                                      ["2", "4", "16", "native"]]


def test_steps_needs_decode(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "--steps", "1"]) == 2
    assert "--decode" in capsys.readouterr().err
