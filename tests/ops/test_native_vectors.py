"""The native kernels' explicit float vectors (``csrc/vec.h``: ``VecF`` and the row passes on it,
``csrc/gemm_vec.h``: the float32 GEMMs on them; neither needs torch): compiled alone for each
instruction set this CPU runs (AVX-512 with ``-march=x86-64-v4``, AVX2 with ``-march=x86-64-v3``)
and checked against the scalar loops they replace, at every length
from 0 to 100 (so every masked tail): max, exp and sum (and the cheaper exp of 16-bit calls
against exp within its error), far-segment dS and the band's add,
with NaN, +-inf and extreme values among the entries; and the float32 GEMMs on those vectors
against the scalar chain of fused multiply-adds they compute, bit for bit. The
whole kernels run the vectors of the machine's build; the other build's vectors are checked here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import relpos.ops.native
from relpos.ops.native.variants import runnable, variant

_CSRC = Path(relpos.ops.native.__file__).with_name("csrc")

# A main that runs each vector primitive against its scalar definition and prints one line per
# disagreement, then "checked N".
_MAIN = r"""
#include "vec.h"
#include "gemm_vec.h"

#include <cstdio>
#include <random>
#include <vector>

using namespace relpos_native;

#define FAIL(...) (++bad, std::printf(__VA_ARGS__), std::printf("\n"))

static bool same(float a, float b, float rel) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= rel * std::max(std::fabs(a), std::fabs(b)) + 1e-37f;
}

int main() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float canary = 12345.0f;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 19);
  long checked = 0, bad = 0;
  for (int trial = 0; trial < 40; ++trial) {
    for (int64_t n = 0; n <= 100; ++n) {
      // entries: normal, with some -inf (hidden keys), and in odd trials NaN, +inf, huge
      std::vector<float> x(n + 32, canary);
      for (int64_t j = 0; j < n; ++j) {
        const int r = pick(gen);
        x[j] = r == 0 ? -inf : normal(gen);
        if (trial % 2 == 1 && r == 1) x[j] = nan;
        if (trial % 4 == 3 && r == 2) x[j] = inf;
        if (trial % 8 == 5 && r == 3) x[j] = -3.0e38f;
      }
      // row_max: the largest entry, NaN skipped, -inf when there is none
      float want_max = -inf;
      for (int64_t j = 0; j < n; ++j) if (x[j] > want_max) want_max = x[j];
      const float got_max = row_max_vec(x.data(), n);
      ++checked;
      if (!(got_max == want_max)) FAIL("row_max n=%ld: %a != %a", (long)n, got_max, want_max);
      // exp_sum: x[j] = exp(x[j] - offset) and their sum; nothing past n written
      const float offsets[] = {want_max == -inf ? 0.0f : want_max, 1.5f, -20.0f, nan};
      for (float off : offsets) {
        std::vector<float> y = x;
        float want_sum = 0.0f;
        std::vector<float> want(n);
        for (int64_t j = 0; j < n; ++j) { want[j] = exp_float(x[j] - off); want_sum += want[j]; }
        const float got_sum = exp_sum_vec(y.data(), n, off);
        ++checked;
        for (int64_t j = 0; j < n; ++j)
          if (!same(y[j], want[j], 2e-7f)) {
            FAIL("exp n=%ld j=%ld x=%a off=%a: %a != %a", (long)n, (long)j, x[j], off, y[j],
                 want[j]);
            break;
          }
        for (int64_t j = n; j < n + 32; ++j)
          if (y[j] != canary) {
            FAIL("exp_sum wrote past n=%ld at %ld", (long)n, (long)j);
            break;
          }
        if (!same(got_sum, want_sum, 1e-5f))
          FAIL("exp_sum n=%ld off=%a: %a != %a", (long)n, off, got_sum, want_sum);
        // with the bucket masses added in the same pass: the same exps, acc[j] + them, nothing
        // past n written
        {
          std::vector<float> z = x, acc(n + 32, canary), acc0(n + 32, canary);
          for (int64_t j = 0; j < n; ++j) acc[j] = acc0[j] = normal(gen);
          const float acc_sum = exp_sum_vec<false, true>(z.data(), n, off, acc.data());
          ++checked;
          for (int64_t j = 0; j < n + 32; ++j) {
            const float want_acc = j < n ? acc0[j] + y[j] : canary;
            if (!same(z[j], y[j], 0.0f) || !same(acc[j], want_acc, 0.0f)) {
              FAIL("exp_sum acc n=%ld j=%ld: %a %a != %a %a", (long)n, (long)j, z[j], acc[j],
                   y[j], want_acc);
              break;
            }
          }
          if (!same(acc_sum, got_sum, 0.0f))
            FAIL("exp_sum acc n=%ld: sum %a != %a", (long)n, acc_sum, got_sum);
        }
        // the 16-bit calls' cheaper polynomial: within 4e-6 of exp (its own 2.8e-6 and the
        // roundings), the same zeros, infinities and NaNs, nothing past n written
        std::vector<float> z = x;
        const float low_sum = exp_sum_vec<true>(z.data(), n, off);
        ++checked;
        for (int64_t j = 0; j < n; ++j)
          if (!same(z[j], want[j], 4e-6f) || ((want[j] == 0.0f) != (z[j] == 0.0f))) {
            FAIL("low exp n=%ld j=%ld x=%a off=%a: %a != %a", (long)n, (long)j, x[j], off, z[j],
                 want[j]);
            break;
          }
        for (int64_t j = n; j < n + 32; ++j)
          if (z[j] != canary) {
            FAIL("low exp_sum wrote past n=%ld at %ld", (long)n, (long)j);
            break;
          }
        if (!same(low_sum, want_sum, 1e-5f))
          FAIL("low exp_sum n=%ld off=%a: %a != %a", (long)n, off, low_sum, want_sum);
      }
      // far_segment_ds: dp[j] = p[j] (dp[j] - c) and its sum; a non-finite c reaches no lane
      // past n (where p would be 0)
      const float cs[] = {0.25f, -inf, nan};
      for (float c : cs) {
        std::vector<float> p(n + 32, 0.0f), dp = x;
        for (int64_t j = 0; j < n; ++j) p[j] = std::fabs(normal(gen));
        float want_sum = 0.0f, abs_sum = 0.0f;
        std::vector<float> want(n);
        for (int64_t j = 0; j < n; ++j) {
          want[j] = p[j] * (x[j] - c);
          want_sum += want[j];
          abs_sum += std::fabs(want[j]);
        }
        const float got_sum = far_segment_ds_vec(p.data(), dp.data(), n, c);
        ++checked;
        for (int64_t j = 0; j < n; ++j)
          if (!same(dp[j], want[j], 2e-7f)) {
            FAIL("ds n=%ld j=%ld: %a != %a", (long)n, (long)j, dp[j], want[j]);
            break;
          }
        for (int64_t j = n; j < n + 32; ++j)
          if (dp[j] != canary) {
            FAIL("ds wrote past n=%ld at %ld", (long)n, (long)j);
            break;
          }
        // summed in another order: within float rounding of the sum of magnitudes
        const bool close = std::isfinite(want_sum)
                               ? std::fabs(got_sum - want_sum) <= 1e-5f * abs_sum + 1e-30f
                               : same(got_sum, want_sum, 0.0f);
        if (!close) FAIL("ds sum n=%ld c=%a: %a != %a", (long)n, c, got_sum, want_sum);
      }
      // add_to: dst[j] += src[j]; nothing past n written
      {
        std::vector<float> dst = x, src(n + 32);
        for (int64_t j = 0; j < n + 32; ++j) src[j] = normal(gen);
        add_to_vec(dst.data(), src.data(), n);
        ++checked;
        for (int64_t j = 0; j < n + 32; ++j) {
          const float want = j < n ? x[j] + src[j] : canary;
          if (!same(dst[j], want, 0.0f)) {
            FAIL("add_to n=%ld j=%ld: %a != %a", (long)n, (long)j, dst[j], want);
            break;
          }
        }
      }
    }
  }
  // vec_sgemm_run: C (M, N) = alpha op(A) @ op(B) + beta C, each element one chain of fused
  // multiply-adds in k order, times alpha fused with the add of C (the same bits as that in
  // scalars); A and B with row strides past their widths, op transposed or not, every row and
  // column tail; C's padding untouched
  long gemms = 0;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (int64_t M : {1, 2, 5, 6, 7, 13})
        for (int64_t N : {1, 7, 8, 15, 16, 17, 33, 64, 65, 70, 129})
          for (int64_t K : {1, 3, 64})
            for (float beta : {0.0f, 1.0f}) {
              const float alpha = 0.125f * (1 + ta + 2 * tb);
              const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
              std::vector<float> A((ta ? K : M) * lda), B((tb ? N : K) * ldb);
              std::vector<float> C(M * ldc), want(M * ldc);
              for (auto& a : A) a = unit(gen);
              for (auto& b : B) b = unit(gen);
              for (auto& c : C) c = unit(gen);
              want = C;
              for (int64_t i = 0; i < M; ++i)
                for (int64_t j = 0; j < N; ++j) {
                  float acc = 0.0f;
                  for (int64_t k = 0; k < K; ++k)
                    acc = std::fma(ta ? A[k * lda + i] : A[i * lda + k],
                                   tb ? B[j * ldb + k] : B[k * ldb + j], acc);
                  want[i * ldc + j] = beta == 0.0f ? acc * alpha
                                                   : std::fma(acc, alpha, C[i * ldc + j]);
                }
              vec_sgemm_run(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(),
                            ldc);
              ++gemms;
              for (int64_t x = 0; x < M * ldc; ++x)
                if (!(C[x] == want[x])) {
                  FAIL("gemm ta=%d tb=%d M=%ld N=%ld K=%ld beta=%g at %ld: %a != %a", ta, tb,
                       (long)M, (long)N, (long)K, beta, (long)x, C[x], want[x]);
                  break;
                }
            }
  std::printf("gemms %ld\n", gemms);
  std::printf("checked %ld\n", checked);
  return bad == 0 ? 0 : 1;
}
"""


def _source() -> str:
    """The main above, which includes the kernels' vector headers (compiled with ``-I`` csrc)."""
    return _MAIN


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.parametrize(("name", "flags"), [("avx512", "-march=x86-64-v4"),
                                             ("avx2", "-march=x86-64-v3")])
def test_the_vector_row_passes_equal_the_scalar_loops(name: str, flags: str,
                                                      tmp_path: Path) -> None:
    if not runnable(variant(name)):
        pytest.skip(f"this CPU does not run {name}")
    source = tmp_path / "vectors.cpp"
    source.write_text(_source())
    binary = tmp_path / "vectors"
    built = subprocess.run(["c++", "-O2", "-std=c++17", flags, f"-I{_CSRC}", str(source), "-o",
                            str(binary)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    # the section compiled its vectors, not the scalar fallback
    probe = subprocess.run(["c++", "-std=c++17", flags, f"-I{_CSRC}", "-dM", "-E", "-x", "c++",
                            str(source)], capture_output=True, text=True)
    assert "#define RELPOS_VEC_FLOAT 1" in probe.stdout
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]
    assert run.stdout.strip().endswith("checked " + str(40 * 101 * 17)), run.stdout[-500:]
    assert f"gemms {2 * 2 * 6 * 11 * 3 * 2}\n" in run.stdout, run.stdout[-500:]
