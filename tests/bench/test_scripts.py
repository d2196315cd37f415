"""The benchmark scripts of relpos.bench (cuda_check, w2v_bert, ct2_decode, eole,
encoder_variants, kernel_variants, varlen, half_precision, generate_packed, first_step): they
import no optional package until they run, and each starts as ``python -m relpos.bench.NAME``,
the command their committed reports give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("relpos.bench.cuda_check", "relpos.bench.w2v_bert", "relpos.bench.ct2_decode",
           "relpos.bench.eole", "relpos.bench.encoder_variants", "relpos.bench.kernel_variants",
           "relpos.bench.varlen", "relpos.bench.half_precision", "relpos.bench.generate_packed",
           "relpos.bench.first_step")
OPTIONAL = ("transformers", "ctranslate2", "eole", "onnx", "triton", "flash_attn")


def test_modules_import_no_optional_package() -> None:
    code = (f"import sys, {', '.join(SCRIPTS)}\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("module", SCRIPTS)
def test_each_script_runs_as_a_module(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ")


def test_benchmarks_holds_scripts_not_launchers() -> None:
    """A script in ``benchmarks/`` is one of the repository's own (no ``relpos.bench`` module
    behind it); the benchmarks of the package run as ``python -m relpos.bench.NAME``."""
    for path in (ROOT / "benchmarks").glob("*.py"):
        assert len(path.read_text().splitlines()) > 30, f"{path.name}: a launcher?"
        assert not (ROOT / "src" / "relpos" / "bench" / path.name).exists(), path.name


def test_script_command_is_the_module() -> None:
    from relpos.bench import common

    assert common.script_command("relpos.bench.eole") == "python -m relpos.bench.eole"


def test_half_precision_times_each_bfloat16_engine(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--bf16-engines`` times the bfloat16 call once per engine beside float32 and names,
    per row, the engine that ran (an engine this machine lacks gives way to the next, so two
    requests may name one engine: it is timed once); the header records the engines the
    loaded kernels run each dtype on."""
    from relpos.bench import half_precision
    from relpos.ops.native import build

    assert half_precision.main([
        "--tokens", "32", "--lengths", "16", "--max-distances", "2", "--repeats", "1",
        "--warmup", "0", "--bf16-engines", "brgemm,widened", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "half_precision_engines.md").read_text()
    rows = (tmp_path / "half_precision_engines.csv").read_text().splitlines()
    assert "| bfloat16 widened |" in report
    names = [row.split(",")[3] for row in rows[1:]]
    assert names[-1] == "bfloat16 widened" and len(names) == len(set(names)) >= 1
    module = build.load()
    assert module is not None
    engines = build.gemm_engines(module)
    assert f"float32 {engines['float32']}, float64 {engines['float64']}, bfloat16 " in report
    assert not (tmp_path / "half_precision.md").exists()


def test_half_precision_refuses_an_unknown_engine(capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.bench import half_precision

    with pytest.raises(SystemExit) as caught:
        half_precision.main(["--bf16-engines", "amx,tpu"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "tpu" in err and "avx512bf16" in err


@pytest.mark.parametrize(("argv", "names"), [
    (["--batches", "1,x"], ("--batches", "'1,x'")),
    (["--threads", "0"], ("--threads", ">= 1")),
    (["--forward-length", "-1"], ("--forward-length", ">= 0")),
    (["--d-model", "30", "--heads", "4"], ("multiple of --heads", "30")),
])
def test_ct2_decode_refuses_bad_options(argv: list[str], names: tuple[str, ...], capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.bench import ct2_decode

    with pytest.raises(SystemExit) as caught:
        ct2_decode.main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err


def test_ct2_decode_without_the_forward_decodes_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--forward-length 0``: the decode rows only, relpos's greedy tokens CTranslate2's."""
    pytest.importorskip("ctranslate2")
    from relpos.bench import ct2_decode

    out = tmp_path / "ct2.md"
    assert ct2_decode.main([
        "--layers", "1", "--d-model", "16", "--heads", "2", "-k", "2", "--vocab", "20",
        "--prompt", "3", "--new-tokens", "4", "--batches", "1,2", "--threads", "1",
        "--repeats", "1", "--warmup", "0", "--forward-length", "0", "--out", str(out)]) == 0
    rows = out.with_suffix(".csv").read_text().splitlines()[1:]
    assert [r.split(",")[:3] for r in rows] == [["decode", "1", "1"], ["decode", "2", "1"]]
    assert all(r.endswith(",True") for r in rows)
    assert "forward |" not in out.read_text()


def test_kernel_variants_times_each_build_and_records_its_gemms(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every build (the native one and each variant asked for) is timed in its own process,
    each ratio to the native build's; the header records the GEMM engines each build's
    kernels said they ran."""
    from relpos.bench import kernel_variants
    from relpos.ops.native import build

    libs = {}
    for name in ("avx2", "baseline"):
        lib = tmp_path / f"torch-x86_64-{name}-0" / "relpos_native_0.so"
        lib.parent.mkdir()
        lib.write_bytes(b"")
        libs[name] = build.Prebuilt(name, lib, runs=True, problem=None)
    monkeypatch.setattr(build, "prebuilt", lambda root: list(libs.values()))
    seen = []

    def one(env, threads, repeats, dtype):  # type: ignore[no-untyped-def]
        seen.append(env)
        variant = bool(env["RELPOS_KERNELS_DIR"])
        ms = 10.0 * (2 if variant else 1)  # a variant: twice the native time
        return {"ms": {kernel_variants._key(s): ms for s in kernel_variants.SHAPES},
                "gemms": {"float32": "brgemm" if variant else "vec", "float64": "blas"}}

    monkeypatch.setattr(kernel_variants, "_one", one)
    table, meta = kernel_variants.run(tmp_path, rounds=1, repeats=1, threads=1,
                                      variants=["baseline"])
    assert table[0] == "| B x n | native ms | baseline ms (/ native) |"
    assert table[2] == "| 32 x 64 | 10.0 | 20.0 (2.00x) |"
    assert meta["command"].endswith("--variants baseline")
    assert meta["native GEMMs"] == "float32 vec, float64 blas"
    assert meta["baseline GEMMs"] == "float32 brgemm, float64 blas"
    assert len(seen) == 2
    assert not any("avx2" in env["RELPOS_KERNELS_DIR"] for env in seen)


def test_kernel_variants_refuses_a_variant_it_does_not_know(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.bench import kernel_variants

    with pytest.raises(SystemExit) as caught:
        kernel_variants.main(["--dir", str(tmp_path), "--variants", "baseline,avx9"])
    assert caught.value.code == 2
    assert "--variants: unknown ['avx9']; allowed: [" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_first_step_measures_each_variant_in_a_fresh_process(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from relpos.bench import first_step

    cells = []

    def one_cell(variant, n, causal, threads):  # type: ignore[no-untyped-def]
        cells.append(variant)
        return first_step._cell(variant, n, causal, threads)  # in this process: quick

    monkeypatch.setattr(first_step, "measure", one_cell)
    assert first_step.main(["--sizes", "80", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert cells == list(first_step.VARIANTS) * 2  # non-causal, causal
    report = (tmp_path / "first_step.md").read_text()
    assert "| 80 | yes | relpos packed (" in report and "peak MiB SDPA / relpos" in report
    rows = (tmp_path / "first_step.csv").read_text().splitlines()
    assert len(rows) == 1 + 6 and rows[0].startswith("n,causal,variant,peak_mib")
    fresh = first_step.measure("relpos", 80, True, 1)  # a real spawn: every field there
    assert set(first_step.FIELDS) <= set(fresh), fresh
    assert fresh["saved_mib"] > 0 and fresh["first_ms"] > 0
