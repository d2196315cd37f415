"""``relpos.ops._numerics.exp_``: the exponential the flash_regions and decode backends use; and the
native kernels' own float32 exponential."""

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import relpos.ops.native
from relpos.ops._numerics import exp_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_matches_torch_exp_over_the_whole_range(dtype):
    finfo = torch.finfo(dtype)
    x = torch.cat([
        torch.linspace(-120.0, 80.0, 20001, dtype=dtype),
        torch.tensor([0.0, -0.0, finfo.min, -1e4, -745.2, -88.8, math.inf, -math.inf],
                     dtype=dtype),
    ])
    got, want = exp_(x.clone()), torch.exp(x)
    assert got.dtype == dtype
    # relative error of one rounded product: |x| * log2(e) * eps / 2 in the exponent
    fin = x.isfinite() & want.isfinite()
    rel = (x.abs() * 1.5 + 2) * finfo.eps
    bound = torch.where(want > 0, rel * want, 0) + finfo.tiny
    assert torch.all((got - want)[fin].abs() <= bound[fin])
    assert got[x == 0].eq(1).all()
    assert got[x == -math.inf].eq(0).all() and got[x == math.inf].eq(math.inf).all()
    # as probabilities (x <= 0): absolute error below one ulp of 1
    neg = x <= 0
    assert (got[neg] - want[neg]).abs().max() <= finfo.eps


def test_exp_propagates_nan_and_works_in_place():
    x = torch.tensor([math.nan, 1.0, -math.inf])
    out = exp_(x)
    assert out.data_ptr() == x.data_ptr()
    assert math.isnan(out[0]) and out[1] == pytest.approx(math.e, rel=1e-6) and out[2] == 0


# The native kernels' own float32 exponential (csrc/vec.h, exp_float; the header needs no
# torch), compiled alone with the undefined-behaviour sanitizer: NaN and +-inf must take no
# undefined step (a shift of a negative or too large int) and give NaN, inf and 0.
_CSRC = Path(relpos.ops.native.__file__).with_name("csrc")

_EXP_MAIN = r"""
#include "vec.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>
int main() {
  const float inf = std::numeric_limits<float>::infinity();
  const uint32_t nan_bits[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7FFFFFFFu,
                               0xFF800001u};
  float xs[6 + 12] = {inf, -inf, 0.0f, -0.0f, 1.0f, -1.0f, 88.0f, -87.0f, 89.0f, -104.0f,
                      3.4e38f, -3.4e38f};
  for (int i = 0; i < 6; ++i) std::memcpy(&xs[12 + i], &nan_bits[i], 4);
  for (float x : xs) {
    using relpos_native::exp_float;
    volatile float in = x;  // no constant folding: the sanitizer checks the real steps
    std::printf("%a %a\n", static_cast<double>(x), static_cast<double>(exp_float(in)));
  }
  return 0;
}
"""


def _exp_float_source() -> str:
    """A main that prints the kernels' exp_float (csrc/vec.h, compiled with ``-I`` csrc) for NaN,
    +-inf and a few finite values."""
    return _EXP_MAIN


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_native_float_exp_has_no_undefined_behaviour_on_nan_and_inf(tmp_path) -> None:  # type: ignore[no-untyped-def]
    flags = ["-O2", "-std=c++17", "-fsanitize=undefined", "-fno-sanitize-recover=all"]
    probe = tmp_path / "probe.cpp"
    probe.write_text("int main() { return 0; }\n")
    if subprocess.run(["c++", *flags, str(probe), "-o", str(tmp_path / "probe")],
                      capture_output=True).returncode != 0:
        pytest.skip("the compiler has no undefined-behaviour sanitizer")
    source = tmp_path / "exp.cpp"
    source.write_text(_exp_float_source())
    binary = tmp_path / "exp"
    built = subprocess.run(["c++", *flags, f"-I{_CSRC}", str(source), "-o", str(binary)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True)
    assert run.returncode == 0 and "runtime error" not in run.stderr, run.stderr
    results = [tuple(float.fromhex(v) for v in line.split()) for line in run.stdout.split("\n")
               if line]
    assert len(results) == 18
    for x, y in results:
        if math.isnan(x):
            assert math.isnan(y)
        elif x == math.inf:
            assert y == math.inf
        elif x < -88:
            assert y == 0.0
        elif x < 88.5:
            assert y == pytest.approx(math.exp(x), rel=1e-6)
