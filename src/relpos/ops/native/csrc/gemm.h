// The kernels' GEMMs: one front, gemm<T> (row-major C = alpha · op(A) @ op(B) + beta · C) and the
// three forms the kernels call (gemm_nn, gemm_nt, gemm_tn), and the engine choice. float32 runs
// on the kernels' vectors (vec_sgemm, gemm_vec.h) where the build has AVX-512, else on the BLAS's
// sgemm_ (gemm_blas.h), float64 on dgemm_; both on libtorch's matrix multiply where it exports
// no BLAS. A bfloat16 call's 16-bit GEMMs run on AMX tiles, on VDPBF16PS tiles (gemm_tiles.h),
// on MKL's 16-bit GEMM, or on tiles widened to float32 (bf16_gemm, half_gemms_now, and per
// block size tile_gemms_of). The switches (docs/numerics.md):
//
//   RELPOS_NATIVE_SGEMM=vec|blas      float32 GEMMs (read once per process)
//   RELPOS_NATIVE_BLAS=aten|blas      the GEMMs not on the kernels' vectors (once per process)
//   RELPOS_NATIVE_BF16_GEMM=amx|avx512bf16|mkl|widened, RELPOS_NATIVE_HALF_GEMM=0|1,
//   RELPOS_NATIVE_AMX=0               a 16-bit call's GEMMs (read by each call)

#pragma once

#include "blocks.h"
#include "config.h"
#include "gemm_blas.h"
#include "gemm_tiles.h"
#include "gemm_vec.h"

#include <torch/extension.h>

namespace relpos_native {

// The environment variable `name`, or "" where it is unset.
static std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// Whether the GEMMs not on the kernels' vectors run on libtorch's matrix multiply rather than
// the BLAS's sgemm_/dgemm_: always without them (RELPOS_HAVE_BLAS unset), else where
// RELPOS_NATIVE_BLAS=aten asks (blas, or unset, keeps sgemm_/dgemm_).
static bool aten_gemm_on() {
  static const bool on = [] {
    const char* v = std::getenv("RELPOS_NATIVE_BLAS");
    const std::string want = v != nullptr ? v : "";
    TORCH_CHECK(want.empty() || want == "aten" || want == "blas",
                "relpos native: RELPOS_NATIVE_BLAS must be aten or blas (or unset), got '", want,
                "'");
#ifdef RELPOS_HAVE_BLAS
    return want == "aten";
#else
    return true;
#endif
  }();
  return on;
}

// Whether float32 GEMMs run on vec_sgemm_run: by default where the build has AVX-512 (AVX2's
// ran at MKL's speed, 0.97-1.17x its time in the forward on an AMD EPYC Zen 4, so AVX2 builds
// keep the BLAS); RELPOS_NATIVE_SGEMM=vec or blas (read once per process) asks for one. beta
// is 0 or 1 in every call.
static bool vec_sgemm_on() {
#if defined(RELPOS_VEC_FLOAT)
  static const bool on = [] {
    const std::string want = env_or_empty("RELPOS_NATIVE_SGEMM");
    TORCH_CHECK(want.empty() || want == "vec" || want == "blas",
                "relpos native: RELPOS_NATIVE_SGEMM must be vec or blas (or unset), got '", want,
                "'");
#if defined(__AVX512F__)
    return want != "blas";
#else
    return want == "vec";
#endif
  }();
  return on;
#else
  return false;
#endif
}

// The fewest rows of C for which a GEMM reading B transposed pays for B^T's copy: a decode-like
// call (one to a few queries over thousands of keys) transposed all of K_J for one row of
// scores (one thread, AMD EPYC Zen 4, 8192 keys, D = 64: the call took 1.8x its time on MKL
// at one query, 1.1x at four, 0.75x at eight and sixteen).
constexpr int64_t kTransposedRows = 8;

// float32 GEMMs on the kernels' own vectors where the build has them (vec_sgemm_run): false
// where it leaves the call to the BLAS.
static bool vec_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                      const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                      float* C, int64_t ldc) {
#if defined(RELPOS_VEC_FLOAT)
  if (!vec_sgemm_on() || (beta != 0.0f && beta != 1.0f)) return false;
  if (tb && M < kTransposedRows) return false;
  vec_sgemm_run(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  return true;
#else
  (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)lda, (void)B;
  (void)ldb, (void)beta, (void)C, (void)ldc;
  return false;
#endif
}

// ------------------------------------------------------------------------------------------
// The front: row-major C[M, N] = alpha * op(A)[M, K] @ op(B)[K, N] + beta * C, on the kernels'
// vectors (vec_sgemm), libtorch's matrix multiply (aten_gemm_on) or the BLAS.
template <typename T>
static inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                        int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (vec_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
  }
  if (aten_gemm_on()) {
    gemm_aten(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
#ifdef RELPOS_HAVE_BLAS
  // Column-major BLAS on row-major data: C^T = op(B)^T op(A)^T.
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  const char* cta = tb ? "T" : "N";
  const char* ctb = ta ? "T" : "N";
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(cta, ctb, &m, &n, &k, &alpha, B, &lb, A, &la, &beta, C, &lc);
  } else {
    dgemm_(cta, ctb, &m, &n, &k, &alpha, B, &lb, A, &la, &beta, C, &lc);
  }
#endif
}

// The three forms the kernels use, on packed row-major matrices (each row's stride is its
// width), named by which operand is read transposed; beta is 0 (overwrite C) or 1 (add to C).

// C (M, N) = alpha · A (M, K) @ B (K, N) + beta · C
template <typename T>
static inline void gemm_nn(int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B, T beta,
                           T* C) {
  gemm<T>(false, false, M, N, K, alpha, A, K, B, N, beta, C, N);
}

// C (M, N) = alpha · A (M, K) @ B^T + beta · C, B (N, K)
template <typename T>
static inline void gemm_nt(int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B, T beta,
                           T* C) {
  gemm<T>(false, true, M, N, K, alpha, A, K, B, K, beta, C, N);
}

// C (M, N) = alpha · A^T @ B (K, N) + beta · C, A (K, M)
template <typename T>
static inline void gemm_tn(int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B, T beta,
                           T* C) {
  gemm<T>(true, false, M, N, K, alpha, A, M, B, N, beta, C, N);
}

// ------------------------------------------------------------------------------------------
// The 16-bit calls' engines

// What bfloat16 calls run their 16-bit GEMMs on: AMX tiles, VDPBF16PS on the same packed tiles,
// MKL's cblas_gemm_bf16bf16f32, or none (kWidened: tiles widened to float32 for the float
// GEMMs, P and dS unrounded).
enum class Bf16Gemm : uint8_t { kWidened, kMkl, kAmx, kDot };

// The choice for this call. By default: AMX where this build has it and the OS grants it; else
// VDPBF16PS where this build has it and it pays (dot_products_pay); else MKL's GEMM where the CPU
// has AMX-BF16 (a portable build on such a CPU: MKL runs it on the tiles); else widened tiles
// (MKL's bfloat16 GEMM without AMX took 1.06-1.51x their time with MKL held to AVX2, AVX-512 or
// AVX512-BF16, benchmarks/half_precision_engines_xeon.md). RELPOS_NATIVE_BF16_GEMM=amx,
// avx512bf16, mkl or widened asks for one (one this build or CPU lacks gives way to the next in
// that order); without it RELPOS_NATIVE_HALF_GEMM=0 asks for widened, then RELPOS_NATIVE_AMX=0
// (older) for mkl, RELPOS_NATIVE_HALF_GEMM=1 for the first 16-bit GEMM there is (amx,
// avx512bf16, mkl). MKL's bfloat16 GEMM must exist for any of them (the tile GEMMs' short
// blocks run on it).
static Bf16Gemm bf16_gemm() {
  const std::string want = env_or_empty("RELPOS_NATIVE_BF16_GEMM");
  TORCH_CHECK(want.empty() || want == "amx" || want == "avx512bf16" || want == "mkl" ||
                  want == "widened",
              "relpos native: RELPOS_NATIVE_BF16_GEMM must be amx, avx512bf16, mkl or widened ",
              "(or unset), got '", want, "'");
  if (!has_low_gemm<c10::BFloat16>()) return Bf16Gemm::kWidened;
  const bool amx = amx_granted();
#ifdef RELPOS_HAVE_BF16_TILES
  const bool dot = true;
#else
  const bool dot = false;
#endif
  const auto first_from = [&](int from) {  // 0 amx, 1 avx512bf16, 2 mkl, 3 widened
    if (from <= 0 && amx) return Bf16Gemm::kAmx;
    if (from <= 1 && dot) return Bf16Gemm::kDot;
    if (from <= 2) return Bf16Gemm::kMkl;
    return Bf16Gemm::kWidened;
  };
  if (!want.empty())
    return first_from(want == "amx" ? 0 : want == "avx512bf16" ? 1 : want == "mkl" ? 2 : 3);
  const std::string half = env_or_empty("RELPOS_NATIVE_HALF_GEMM");
  if (half == "0") return Bf16Gemm::kWidened;
  if (env_or_empty("RELPOS_NATIVE_AMX") == "0") return Bf16Gemm::kMkl;
  if (half == "1") return first_from(0);
  if (amx) return Bf16Gemm::kAmx;
#ifdef RELPOS_HAVE_BF16_TILES
  if (dot_products_pay()) return Bf16Gemm::kDot;
#endif
  return cpu_has_amx_bf16() ? Bf16Gemm::kMkl : Bf16Gemm::kWidened;
}

// A call's 16-bit GEMMs, chosen once per call: whether it runs 16-bit GEMMs (low; else its
// tiles are widened to float and the float GEMMs serve: the same results to float rounding, P
// and dS unrounded) and, for bfloat16, the packed-tile engine its large enough blocks run on
// (tile_gemms_of). bfloat16 as bf16_gemm() says; float16 only under RELPOS_NATIVE_HALF_GEMM=1
// (where libtorch has the GEMM): MKL's float16 GEMM measured slower than widened tiles even on
// a CPU with AVX512-FP16 (benchmarks/half_precision_xeon.md), and CPUs without FP16 arithmetic can
// only convert inside it.
struct HalfGemms {
  bool low = false;
  TileGemm tiles = kNoTiles;
};

template <typename I>
static HalfGemms half_gemms_now() {
  if (!has_low_gemm<I>()) return {};
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    const Bf16Gemm e = bf16_gemm();
    return {e != Bf16Gemm::kWidened, e == Bf16Gemm::kAmx   ? kAmxTiles
                                     : e == Bf16Gemm::kDot ? kDotTiles
                                                           : kNoTiles};
  }
  return {env_or_empty("RELPOS_NATIVE_HALF_GEMM") == "1", kNoTiles};
}

// The fewest query rows per block for which a direction's GEMMs run on packed tiles: shorter
// blocks fill too little of the 32-row tile pairs (bfloat16 on AMX, 128 sequences, K = 16, one
// thread: the forward at n = 12 took 1.15x MKL's time on tiles, at n = 20 0.93x; forward +
// backward 1.1x at n = 12, 1.0x at n = 20 and 28, 0.97x at n = 40).
constexpr int64_t kAmxForwardRows = 16;
constexpr int64_t kAmxBackwardRows = 32;
// VDPBF16PS computes only the 8-row groups a block has, but packs K and V tiles alike for any
// (AMD EPYC Zen 4, one thread, B x n = 2048 tokens, K = 16: on tiles against widened tiles the
// forward took 1.30x at n = 8, 1.05x at 12, 0.83x at 16, 0.86x at 24; forward + backward
// 1.33x, 1.16x, 0.85x, 0.93x).
constexpr int64_t kDotRows = 16;

// Where a call whose tile GEMMs take 16-bit operands runs them: on its packed-tile engine
// (half_gemms_now's) with query blocks of at least amx_rows rows on AMX, kDotRows by VDPBF16PS
// (BQ, a varlen call's longest), and key tiles of at most kKeyBlock, else on MKL's GEMM
// (kNoTiles).
static TileGemm tile_gemms_of(const HalfGemms& gemms, int64_t BQ, int64_t BK, int64_t amx_rows) {
  const int64_t min_rows = gemms.tiles == kDotTiles ? kDotRows : amx_rows;
  if (!gemms.low || BQ < min_rows || BK > kKeyBlock) return kNoTiles;
  return gemms.tiles;
}

// A call's 16-bit GEMMs for query blocks of BQ rows: where VDPBF16PS was chosen and the blocks
// are too short for its tiles, the call runs as a CPU without AMX runs bfloat16 best, on
// widened tiles (MKL's bfloat16 GEMM, which tile_gemms_of would give it, took 1.5-1.8x their
// time there at n = 8), unless the CPU has AMX for MKL (RELPOS_NATIVE_BF16_GEMM=avx512bf16 on
// such a CPU). Decided before the call's inputs are prepared (its tables' 16-bit copies).
static HalfGemms for_query_blocks(HalfGemms gemms, int64_t BQ) {
  if (gemms.tiles == kDotTiles && BQ < kDotRows && !cpu_has_amx_bf16()) return {};
  return gemms;
}

}  // namespace relpos_native
