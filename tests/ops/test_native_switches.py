"""The native kernels' environment switches (relpos._env, engines.disabled): RELPOS_NATIVE read
one way (an unknown value ignored with one warning); the two GEMM switches the kernels read
themselves, RELPOS_NATIVE_FLOAT_GEMM and RELPOS_NATIVE_BF16_GEMM, written back as the kernels
accept them and an unknown value refused with a ValueError naming the variable, the value and
the engines; the loaded kernels' gemm_engines() follows them; the switches of development
versions before them said once to have no effect."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import relpos
from relpos import _env
from relpos.ops.native import build, engines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Each GEMM switch, a value it accepts given with spaces and capitals (and what it is read
#: as), and one that names no engine.
GEMM_SWITCHES = [
    ("RELPOS_NATIVE_FLOAT_GEMM", " BRGEMM ", "brgemm", "blas"),
    ("RELPOS_NATIVE_BF16_GEMM", " Widened", "widened", "mkl"),
]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No switch set, no value warned about yet."""
    monkeypatch.setattr(_env, "_warned", set())
    for name in ("RELPOS_NATIVE", *engines.GEMM_SWITCHES, *engines.REMOVED_SWITCHES):
        monkeypatch.delenv(name, raising=False)


def _kernels():  # type: ignore[no-untyped-def]
    module = build.load()
    assert module is not None, build.failure()
    return module


def test_gemm_engines_answers_for_every_dtype() -> None:
    """The loaded kernels name an engine for each dtype they serve, one of those they have."""
    said = build.gemm_engines(_kernels())
    assert set(said) == {"float32", "float64", "bfloat16", "float16"}, said
    assert said["float32"] in engines.FLOAT_ENGINES, said
    assert said["float64"] in ("blas", "aten"), said
    assert said["float64"] == ("blas" if build.have_blas() else "aten"), said
    assert said["bfloat16"] in engines.BF16_ENGINES, said
    assert said["float16"] == "widened", said
    facts = build.build_facts(_kernels())
    if facts["vectors"] == "avx512":  # the kernels' own code where the build has AVX-512
        assert said["float32"] == "vec", said
    if facts["amx"] == "bf16":  # AMX tiles first wherever the build and the OS have them
        assert said["bfloat16"] == "amx", said


def test_gemm_engines_follow_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set a switch, and the kernels' answer changes with it, at once (read at each call);
    an engine the build or CPU lacks gives way to the next (amx, avx512bf16, brgemm,
    widened)."""
    module = _kernels()
    facts = build.build_facts(module)
    default = build.gemm_engines(module)
    for value in engines.FLOAT_ENGINES:
        monkeypatch.setenv("RELPOS_NATIVE_FLOAT_GEMM", value)
        said = build.gemm_engines(module)
        want = value if facts["vectors"] != "none" else "brgemm"  # no vectors: brgemm
        assert said["float32"] == want, (value, said)
        assert {k: v for k, v in said.items() if k != "float32"} == \
            {k: v for k, v in default.items() if k != "float32"}
    monkeypatch.delenv("RELPOS_NATIVE_FLOAT_GEMM")
    has_amx, has_dot = facts["amx"] == "bf16", facts["avx512bf16"] == "bf16"
    has_brgemm = "bf16" in facts["brgemm"].split(",")
    brgemm = "brgemm" if has_brgemm else "widened"
    expected = {"amx": "amx" if has_amx else "avx512bf16" if has_dot else brgemm,
                "avx512bf16": "avx512bf16" if has_dot else brgemm,
                "brgemm": brgemm, "widened": "widened"}
    for value, want in expected.items():
        monkeypatch.setenv("RELPOS_NATIVE_BF16_GEMM", value)
        said = build.gemm_engines(module)
        assert said["bfloat16"] == want, (value, said, facts)
        assert module.bf16_gemm() == want
        assert said["float32"] == default["float32"]
    monkeypatch.delenv("RELPOS_NATIVE_BF16_GEMM")
    assert build.gemm_engines(module) == default


@pytest.mark.parametrize(("name", "spelled", "read", "unknown"), GEMM_SWITCHES)
def test_a_gemm_switch_is_written_back_as_the_kernels_take_it_and_an_unknown_value_refused(
        name: str, spelled: str, read: str, unknown: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = _kernels()
    monkeypatch.setenv(name, read)
    as_read = build.gemm_engines(module)
    monkeypatch.setenv(name, spelled)  # written back as the kernels accept it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not build.disabled()
        assert os.environ[name] == read
        assert build.gemm_engines(module) == as_read
    monkeypatch.setenv(name, unknown)
    allowed = ", ".join(engines.GEMM_SWITCHES[name])
    said = f"relpos: {name}={unknown!r} is none of {allowed} (or unset)"
    for _ in range(2):  # refused every time, not once
        with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
            build.disabled()
    with pytest.raises(ValueError, match=name):
        build.gemm_engines(module)
    assert os.environ[name] == unknown  # left as it is: the call is refused, not re-routed
    # a call the kernels would serve is refused with the same words, padded and packed
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=name):
        relpos.relative_attention(q, q, q, max_distance=2, implementation="native")
    with pytest.raises(ValueError, match=name):
        relpos.relative_attention(q, q, q, max_distance=2)  # auto-selection asks too
    # with the kernels off the switch changes nothing and nothing is refused
    monkeypatch.setenv("RELPOS_NATIVE", "0")
    assert build.disabled()
    relpos.relative_attention(q, q, q, max_distance=2)


def test_relpos_kernels_refuses_an_unknown_engine_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from relpos.cli import main

    monkeypatch.setenv("RELPOS_NATIVE_BF16_GEMM", " TPU ")
    assert main(["kernels"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "RELPOS_NATIVE_BF16_GEMM=' TPU ' is none of amx, avx512bf16, brgemm, widened" in err


@pytest.mark.parametrize("name", sorted(engines.REMOVED_SWITCHES))
def test_a_removed_switch_is_said_once_to_have_no_effect(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set (to any value), a removed switch is said once per process to change nothing,
    with what replaces it; the engines are those of the environment without it."""
    module = _kernels()
    default = build.gemm_engines(module)
    monkeypatch.setenv(name, "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not build.disabled()
        assert build.gemm_engines(module) == default
        monkeypatch.setenv(name, "1")  # another value: still said once
        assert not build.disabled()
        assert build.gemm_engines(module) == default
    said = [str(w.message) for w in caught]
    assert len(said) == 1, said
    assert said[0].startswith(f"relpos: {name} no longer has an effect; instead: "), said
    assert engines.REMOVED_SWITCHES[name] in said[0], said


@pytest.mark.parametrize(("value", "off", "warned"), [
    ("0", True, False), (" OFF ", True, False), ("No", True, False), ("false", True, False),
    ("1", False, False), ("yes", False, False), ("", False, False), ("maybe", False, True),
    ("disable", False, True)])
def test_relpos_native_is_read_one_way(value: str, off: bool, warned: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELPOS_NATIVE", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.disabled() == off
        assert build.disabled() == off
    said = [str(w.message) for w in caught]
    assert said == ([f"relpos: RELPOS_NATIVE={value!r} is none of 0, 1, true, on, yes, false, "
                     "off, no (or unset); it is ignored: the native kernels stay on."]
                    if warned else []), said


def test_decode_packing_is_read_one_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from relpos.models import decoding

    monkeypatch.delenv(decoding.PACKING_ENV, raising=False)
    default = decoding.decode_packing()
    monkeypatch.setenv(decoding.PACKING_ENV, " NONE ")
    assert decoding.decode_packing() == "none"
    monkeypatch.setenv(decoding.PACKING_ENV, "fastest")  # was a ValueError on every step
    with pytest.warns(RuntimeWarning, match="RELPOS_DECODE_PACKING='fastest' is none of relpos, "
                                            "onednn, mkl, none"):
        assert decoding.decode_packing() == default


def test_in_a_fresh_process_the_removed_switches_warn_once_and_the_kernels_serve() -> None:
    """Every removed switch set, RELPOS_NATIVE and RELPOS_DECODE_PACKING given values they do
    not know: each said once; float32, float64, bfloat16 and float16 calls (forward and
    backward, several times) run on the kernels and match the reference. Then an unknown
    engine: the first call the kernels would serve raises, naming the engines."""
    code = textwrap.dedent("""
        import os, warnings, torch, relpos
        from relpos.models.decoding import decode_packing
        warnings.simplefilter("always")
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) * 2:
            x = [torch.randn(1, 2, 19, 16, generator=g) for _ in range(3)]
            t = torch.randn(7, 16, generator=g)
            a = [v.to(dtype).requires_grad_() for v in (*x, t)]
            out = relpos.relative_attention(*a[:3], max_distance=3, rel_keys=a[3],
                                            implementation="native")
            out.float().sum().backward()
            ref = relpos.relative_attention(*x, max_distance=3, rel_keys=t,
                                            implementation="reference")
            tol = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2
            assert (out.float() - ref).abs().max() <= tol, (dtype, (out.float() - ref).abs().max())
        print(decode_packing())
        print("served")
        os.environ["RELPOS_NATIVE_FLOAT_GEMM"] = "sgemm"
        try:
            relpos.relative_attention(*x, max_distance=3, rel_keys=t)
        except ValueError as error:
            print("refused:", error)
    """)
    removed = dict.fromkeys(engines.REMOVED_SWITCHES, "1")
    bad = {"RELPOS_NATIVE": "maybe", "RELPOS_DECODE_PACKING": "fastest"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **removed, **bad}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-2] == "served", done.stdout
    assert lines[-1] == ("refused: relpos: RELPOS_NATIVE_FLOAT_GEMM='sgemm' is none of vec, "
                         "brgemm (or unset); set RELPOS_NATIVE_FLOAT_GEMM to one of them, or "
                         "unset it"), done.stdout
    for name, value in bad.items():
        assert done.stderr.count(f"{name}={value!r} is none of ") == 1, (name, done.stderr)
    for name in removed:
        assert done.stderr.count(f"{name} no longer has an effect") == 1, (name, done.stderr)
