"""relpos bench (attention): the CLI writes its report at tiny sizes."""

from __future__ import annotations


def test_bench_cli_writes_report(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.cli import main

    status = main([
        "bench", "--lengths", "40", "--max-distances", "3", "--heads", "1", "--head-dim", "8",
        "--repeats", "1", "--warmup", "0", "--no-memory",
        "--backends", "flash_regions,reference,sdpa", "--out", str(tmp_path),
    ])
    assert status == 0
    table = capsys.readouterr().out
    assert "flash_regions" in table and "sdpa" in table
    report = (tmp_path / "attention.md").read_text()
    assert "torch" in report and "relpos bench" in report
    rows = (tmp_path / "attention.csv").read_text().splitlines()
    assert rows[0].startswith("n,K,backend") and len(rows) == 4


def test_bench_cli_causal(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.cli import main

    status = main([
        "bench", "--lengths", "33", "--max-distances", "2", "--heads", "2", "--head-dim", "8",
        "--repeats", "1", "--warmup", "0", "--no-memory", "--backends", "flash_regions,sdpa",
        "--causal", "--out", str(tmp_path),
    ])
    assert status == 0
    report = (tmp_path / "attention.md").read_text()
    assert ", causal" in report and "--causal" in report


def test_bench_cli_rejects_unknown_backend(capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.cli import main

    assert main(["bench", "--backends", "nope", "--no-memory"]) == 2
    assert "nope" in capsys.readouterr().err


def test_the_default_table_has_an_auto_row_naming_its_pick(capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.bench.attention import default_backends
    from relpos.cli import main

    assert default_backends()[0] == "auto" and "decode" not in default_backends()
    status = main([
        "bench", "--lengths", "40,600", "--max-distances", "3", "--heads", "1", "--head-dim",
        "8", "--repeats", "1", "--warmup", "0", "--no-memory", "--backends", "auto,sdpa",
    ])
    assert status == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    auto = [r for r in rows if len(r) > 2 and r[2] == "auto"]
    assert [r[0] for r in auto] == ["40", "600"]
    assert "picks native" in " ".join(auto[0]) and "picks native" in " ".join(auto[1])


def test_the_auto_row_names_the_pytorch_backends_without_the_kernels(capsys, no_native) -> None:  # type: ignore[no-untyped-def]
    from relpos.cli import main

    status = main([
        "bench", "--lengths", "40,600", "--max-distances", "3", "--heads", "1", "--head-dim",
        "8", "--repeats", "1", "--warmup", "0", "--no-memory", "--backends", "auto,sdpa",
    ])
    assert status == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    auto = [r for r in rows if len(r) > 2 and r[2] == "auto"]
    assert "picks reference" in " ".join(auto[0]) and "picks flash_regions" in " ".join(auto[1])
