"""The native kernels' environment switches, read one way (relpos._env, engines.disabled):
stripped and lower-cased; a value that is none of those allowed is ignored with one warning
naming them and what serves instead; no switch makes a call fail (the kernels, which read
some switches themselves and refuse a value they do not know, never see one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from relpos import _env
from relpos.ops.native import build, engines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Each switch the kernels read, a value they accept given with spaces and capitals (and what
#: it is read as), and one that is none of those allowed.
KERNEL_SWITCHES = [
    ("RELPOS_NATIVE_SGEMM", " BLAS ", "blas", "mkl"),
    ("RELPOS_NATIVE_BLAS", "Aten", "aten", "openblas"),
    ("RELPOS_NATIVE_BF16_GEMM", " Widened", "widened", "tpu"),
    ("RELPOS_NATIVE_HALF_GEMM", "Off", "0", "2"),
    ("RELPOS_NATIVE_AMX", " FALSE ", "0", "maybe"),
]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No switch set, no value warned about yet."""
    monkeypatch.setattr(_env, "_warned", set())
    for name in ("RELPOS_NATIVE", *(s[0] for s in KERNEL_SWITCHES)):
        monkeypatch.delenv(name, raising=False)


def _said() -> str:
    """What relpos kernels says of the GEMMs (without loading the kernels)."""
    return f"{engines.float_gemms()} | {engines.half_gemms()}"


@pytest.mark.parametrize(("name", "spelled", "read", "unknown"), KERNEL_SWITCHES)
def test_a_kernel_switch_is_read_one_way_and_an_unknown_value_ignored_with_one_warning(
        name: str, spelled: str, read: str, unknown: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    default = _said()
    monkeypatch.setenv(name, read)
    as_read = _said()
    monkeypatch.setenv(name, spelled)  # written back as the kernels accept it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not build.disabled()
        assert os.environ[name] == read and _said() == as_read
    assert caught == []
    monkeypatch.setenv(name, unknown)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not build.disabled()
        assert name not in os.environ  # the kernels take their default, as said
        assert _said() == default
        monkeypatch.setenv(name, unknown)  # set again: the same value, no second warning
        assert not build.disabled() and _said() == default
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith(f"relpos: {name}={unknown!r} is none of "), said
    assert "(or unset); it is ignored: " in said[0], said


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


def test_every_switch_with_a_bad_value_warns_once_and_the_kernels_serve() -> None:
    """In a fresh process, every switch given a value it does not know: each says so once,
    and float32, float64, bfloat16 and float16 calls (forward and backward, several times) run
    on the kernels and match the reference; before, the kernels refused every such call."""
    code = textwrap.dedent("""
        import warnings, torch, relpos
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
    """)
    bad = {name: unknown for name, _, _, unknown in KERNEL_SWITCHES}
    bad.update(RELPOS_NATIVE="maybe", RELPOS_DECODE_PACKING="fastest")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **bad}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "served", done.stdout
    for name, value in bad.items():
        assert done.stderr.count(f"{name}={value!r} is none of ") == 1, (name, done.stderr)
