"""Which portable variant of the native kernels a CPU runs (relpos.ops.native.variants)."""

from __future__ import annotations

import itertools

import pytest

from relpos.ops.native import build
from relpos.ops.native.variants import runnable, variant, variants

V3 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "avx", "avx2",
                "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AMX = V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}


def test_x86_variants_are_best_first_and_each_needs_what_the_next_needs() -> None:
    found = variants("x86_64")
    assert [v.name for v in found] == ["amx", "avx512bf16", "avx512", "avx2", "baseline"]
    for better, worse in itertools.pairwise(found):
        assert worse.requires <= better.requires and better.requires != worse.requires
    assert variants("aarch64")[0].flags == ("-march=armv8-a",)
    assert [v.name for v in variants("riscv64")] == ["baseline"]


@pytest.mark.parametrize(("flags", "capability", "best"), [
    (AMX, "AVX512", "amx"),
    (AMX - {"amx_bf16"}, "AVX512", "avx512bf16"),  # tiles without their bfloat16 products
    (AMX - {"avx512_bf16"}, "AVX512", "avx512"),  # AMX without AVX512-BF16
    (V4 | {"avx512_bf16"}, "AVX512", "avx512bf16"),  # AVX512-BF16 without AMX (AMD Zen 4)
    (V4 | {"avx512_bf16"}, "AVX2", "avx2"),
    (AMX, "AVX2", "avx2"),
    (V4, "AVX512", "avx512"),
    (V4, "AVX2", "avx2"),  # ATEN_CPU_CAPABILITY=avx2 keeps the kernels at torch's level
    (V4, "DEFAULT", "baseline"),
    (V3, "AVX512", "avx2"),
    (V3 - {"movbe"}, "AVX2", "baseline"),  # AVX2 without all of x86-64-v3
    (V4 - {"avx512cd"}, "AVX512", "avx2"),
    (None, "AVX512", "baseline"),  # no /proc/cpuinfo: only what needs nothing
])
def test_the_best_variant_is_the_first_the_cpu_and_torch_run(
        flags: frozenset[str] | None, capability: str, best: str) -> None:
    if flags is None:
        # runnable reads /proc/cpuinfo when given no flags: point it at a missing file
        import relpos.ops.native.variants as module

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, "cpu_flags", lambda: None)
            chosen = [v.name for v in variants("x86_64") if runnable(v, None, capability)]
    else:
        chosen = [v.name for v in variants("x86_64") if runnable(v, flags, capability)]
    assert chosen[0] == best and chosen[-1] == "baseline"


def test_an_unknown_variant_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"no kernels variant 'avx9' on x86_64 \(allowed: "
                                         r"amx, avx512bf16, avx512, avx2, baseline\)"):
        variant("avx9", "x86_64")


def test_variant_builds_are_keyed_apart_from_the_native_one() -> None:
    native, baseline = build.Target(), build.Target("baseline")
    assert native.key != baseline.key and native.module_name != baseline.module_name
    assert "-march=native" not in " ".join(baseline.cflags)
    assert "-baseline-" in baseline.directory_name
    assert build.build_directory().name == native.directory_name
