// The kernels' GEMMs: one front, gemm<T> (row-major C = alpha · op(A) @ op(B) + beta · C) and the
// three forms the kernels call (gemm_nn, gemm_nt, gemm_tn), and the engine policy, decided here
// and only here (Python asks the loaded module: gemm_engines()). float32 runs on the kernels'
// vectors (vec_sgemm_run, gemm_vec.h) where the build has AVX-512, else on libtorch's brgemm
// (gemm_brgemm.h); float64, and float32's decode-like products, on the BLAS (gemm_blas.h). A
// bfloat16 call's 16-bit GEMMs run on AMX tiles, on VDPBF16PS tiles (gemm_tiles.h), on brgemm,
// or on tiles widened to float32 (bf16_gemm, half_gemms_now, and per block size
// tile_gemms_of); float16 on widened tiles. benchmarks/gemm_engines_epyc.md measured each
// engine against the libraries'. The two switches, read at each call (docs/numerics.md):
//
//   RELPOS_NATIVE_FLOAT_GEMM=vec|brgemm                  float32 GEMMs
//   RELPOS_NATIVE_BF16_GEMM=amx|avx512bf16|brgemm|widened  bfloat16 GEMMs

#pragma once

#include "blocks.h"
#include "config.h"
#include "gemm_blas.h"
#include "gemm_brgemm.h"
#include "gemm_tiles.h"
#include "gemm_vec.h"

#include <torch/extension.h>

#include <atomic>

namespace relpos_native {

// The environment variable `name`, or "" where it is unset.
static std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// What a call's float32 GEMMs run on: the kernels' own vectors (vec_sgemm_run, where the build
// has them) or libtorch's brgemm (oneDNN's micro-kernels). Chosen at each call's entry
// (choose_float_engine) and read by the GEMM front; float64 runs on the BLAS's dgemm_ where
// libtorch exports it, else on libtorch's matrix multiply (decided by the build, no switch).
enum class FloatGemm : uint8_t { kVec, kBrgemm };
inline std::atomic<FloatGemm> g_float_gemm{FloatGemm::kVec};

static bool vec_sgemm_built() {
#if defined(RELPOS_VEC_FLOAT)
  return true;
#else
  return false;
#endif
}

// RELPOS_NATIVE_FLOAT_GEMM=vec|brgemm, else the default: vec where the build has AVX-512
// (benchmarks/gemm_engines_epyc.md), brgemm elsewhere (AVX2's vectors ran at a library's speed,
// 0.97-1.17x MKL's time in the forward on an AMD EPYC Zen 4); vec on a build without vectors
// gives way to brgemm.
static FloatGemm float_gemm_now() {
  const std::string want = env_or_empty("RELPOS_NATIVE_FLOAT_GEMM");
  TORCH_CHECK(want.empty() || want == "vec" || want == "brgemm",
              "relpos native: RELPOS_NATIVE_FLOAT_GEMM must be vec or brgemm (or unset), got '",
              want, "'");
  if (want == "brgemm" || !vec_sgemm_built()) return FloatGemm::kBrgemm;
#if defined(__AVX512F__)
  return FloatGemm::kVec;
#else
  return want == "vec" ? FloatGemm::kVec : FloatGemm::kBrgemm;
#endif
}

// The fewest rows of C for which a GEMM reading B transposed pays for B^T's copy: a decode-like
// call (one to a few queries over thousands of keys) transposed all of K_J for one row of
// scores (one thread, AMD EPYC Zen 4, 8192 keys, D = 64: the call took 1.8x its time on MKL
// at one query, 1.1x at four, 0.75x at eight and sixteen).
constexpr int64_t kTransposedRows = 8;

// The BLAS's sgemm_/dgemm_ where libtorch exports them (RELPOS_HAVE_BLAS), else libtorch's matrix
// multiply: float64's GEMMs, and float32's where B is read transposed by fewer than
// kTransposedRows rows (the BLAS reads B^T in place).
template <typename T>
static inline void blas_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                             int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
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
#else
  gemm_aten(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

// ------------------------------------------------------------------------------------------
// The front: row-major C[M, N] = alpha * op(A)[M, K] @ op(B)[K, N] + beta * C (beta 0 or 1).
// float32 on the call's engine (g_float_gemm: the kernels' vectors or brgemm), except a
// decode-like product (fewer than kTransposedRows rows reading B transposed) on the BLAS;
// float64 on the BLAS.
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
    if (!(tb && M < kTransposedRows)) {
#if defined(RELPOS_VEC_FLOAT)
      if (g_float_gemm == FloatGemm::kVec) {
        vec_sgemm_run(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
      }
#endif
      brgemm_float(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      return;
    }
  }
  blas_gemm<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
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
// libtorch's brgemm on VNNI-packed operands (gemm_brgemm.h; the tile engines' short blocks run
// there too), or none (kWidened: tiles widened to float32 for the float GEMMs, P and dS
// unrounded).
enum class Bf16Gemm : uint8_t { kWidened, kBrgemm, kAmx, kDot };

// The choice for this call. By default: AMX where this build has it and the OS grants it; else
// VDPBF16PS where this build has it and it pays (dot_products_pay); else brgemm where the CPU
// has AMX-BF16 (a portable build on such a CPU: oneDNN runs it on the tiles); else widened tiles
// (benchmarks/gemm_engines_epyc.md: on a CPU without AMX brgemm took 1.4x the VDPBF16PS tiles'
// time, widened tiles 1.6x). RELPOS_NATIVE_BF16_GEMM=amx, avx512bf16, brgemm or widened asks
// for one (one this build or CPU lacks gives way to the next in that order); brgemm needs
// AVX-512 (oneDNN's bfloat16 micro-kernels), without it the call runs on widened tiles.
static Bf16Gemm bf16_gemm() {
  const std::string want = env_or_empty("RELPOS_NATIVE_BF16_GEMM");
  TORCH_CHECK(want.empty() || want == "amx" || want == "avx512bf16" || want == "brgemm" ||
                  want == "widened",
              "relpos native: RELPOS_NATIVE_BF16_GEMM must be amx, avx512bf16, brgemm or widened ",
              "(or unset), got '", want, "'");
  if (!brgemm_bf16_serves()) return Bf16Gemm::kWidened;
  const bool amx = amx_granted();
#ifdef RELPOS_HAVE_BF16_TILES
  const bool dot = true;
#else
  const bool dot = false;
#endif
  const auto first_from = [&](int from) {  // 0 amx, 1 avx512bf16, 2 brgemm, 3 widened
    if (from <= 0 && amx) return Bf16Gemm::kAmx;
    if (from <= 1 && dot) return Bf16Gemm::kDot;
    if (from <= 2) return Bf16Gemm::kBrgemm;
    return Bf16Gemm::kWidened;
  };
  if (!want.empty())
    return first_from(want == "amx" ? 0 : want == "avx512bf16" ? 1 : want == "brgemm" ? 2 : 3);
  if (amx) return Bf16Gemm::kAmx;
#ifdef RELPOS_HAVE_BF16_TILES
  if (dot_products_pay()) return Bf16Gemm::kDot;
#endif
  return cpu_has_amx_bf16() ? Bf16Gemm::kBrgemm : Bf16Gemm::kWidened;
}

// A call's 16-bit GEMMs, chosen once per call: whether it runs 16-bit GEMMs (low; else its
// tiles are widened to float and the float GEMMs serve: the same results to float rounding, P
// and dS unrounded) and, for bfloat16, the packed-tile engine its large enough blocks run on
// (tile_gemms_of). bfloat16 as bf16_gemm() says; float16 always on widened tiles (MKL's
// float16 GEMM measured slower than widened tiles even on a CPU with AVX512-FP16,
// benchmarks/half_precision_xeon.md).
struct HalfGemms {
  bool low = false;
  TileGemm tiles = kNoTiles;
};

template <typename I>
static HalfGemms half_gemms_now() {
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    const Bf16Gemm e = bf16_gemm();
    return {e != Bf16Gemm::kWidened, e == Bf16Gemm::kAmx   ? kAmxTiles
                                     : e == Bf16Gemm::kDot ? kDotTiles
                                                           : kNoTiles};
  }
  return {};
}

// float32's engine for the GEMM front (g_float_gemm), chosen at each call's entry; a 16-bit
// call's engines are its HalfGemms (half_gemms_now), passed down with the call.
static void choose_float_engine() { g_float_gemm = float_gemm_now(); }

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
// (BQ, a varlen call's longest), and key tiles of at most kKeyBlock, else on brgemm
// (kNoTiles).
static TileGemm tile_gemms_of(const HalfGemms& gemms, int64_t BQ, int64_t BK, int64_t amx_rows) {
  const int64_t min_rows = gemms.tiles == kDotTiles ? kDotRows : amx_rows;
  if (!gemms.low || BQ < min_rows || BK > kKeyBlock) return kNoTiles;
  return gemms.tiles;
}

// A call's 16-bit GEMMs for query blocks of BQ rows: where VDPBF16PS was chosen and the blocks
// are too short for its tiles, the call runs as a CPU without AMX runs bfloat16 best, on
// widened tiles (a library's bfloat16 GEMM, which tile_gemms_of would give it, took 1.5-1.8x
// their time there at n = 8), unless the CPU has AMX for brgemm (RELPOS_NATIVE_BF16_GEMM=avx512bf16
// on such a CPU). Decided before the call's inputs are prepared (its tables' 16-bit copies).
static HalfGemms for_query_blocks(HalfGemms gemms, int64_t BQ) {
  if (gemms.tiles == kDotTiles && BQ < kDotRows && !cpu_has_amx_bf16()) return {};
  return gemms;
}

// C (M, N) = alpha · op(A) @ op(B) + beta · C for a call's 16-bit GEMMs off the packed tiles:
// bfloat16 operands on packed row-major matrices (op(A) = A (M, K) or, with ta, A^T for A (K,
// M); op(B) = B (K, N) or, with tb, B^T for B (N, K)), C float, on brgemm.
template <typename I>
static inline void gemm16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                          const I* A, const I* B, float beta, float* C) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t x = 0; x < M * N; ++x) C[x] = beta == 0.0f ? 0.0f : beta * C[x];
    return;
  }
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    brgemm_bf16(ta, tb, M, N, K, alpha, A, B, beta, C);
  } else {  // float16 calls run on widened tiles (half_gemms_now): never here
    (void)ta, (void)tb, (void)alpha, (void)A, (void)B;
    TORCH_CHECK(false, "relpos native: no 16-bit GEMM for ", c10::CppTypeToScalarType<I>::value);
  }
}

}  // namespace relpos_native
