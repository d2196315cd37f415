// The float32 GEMMs on the kernels' own vectors (vec_sgemm_run), where the build has them
// (RELPOS_VEC_FLOAT); gemm.h's vec_sgemm says when they run. No torch:
// tests/ops/test_native_vectors.py compiles it alone.

#pragma once

#include "vec.h"

namespace relpos_native {

#if defined(RELPOS_VEC_FLOAT)
// float32 GEMMs on the kernels' vectors (vec_sgemm): C (M, N) = alpha · op(A) @ op(B) + beta · C
// with beta 0 or 1, row-major, nothing packed. An MR x (NV vectors) block of C stays in
// registers while k runs: each step loads NV vectors of B's row k and broadcasts MR elements of
// A's column k (A or A^T alike, by its two strides), so A is never copied and B only where it is
// read transposed (op(B) = B^T: B^T into a thread's buffer, one pass; for C of at least
// kTransposedRows rows). Each element is one chain of fused multiply-adds in k order, then
// times alpha (fused with the add of C where beta is 1): the same bits at every thread count
// (and MKL's bits where compared, AMD EPYC Zen 4). MKL's sgemm packs both operands on every
// call: at the kernels' tile sizes (128 x 128 x 64, one thread, that CPU) its packing took a
// third of its GEMM time; these took 0.72-0.85x its time for P @ V and Pb @ aV, the forward
// 0.85-0.98x and forward + backward 0.82-0.96x the time on MKL (AVX-512; vec_sgemm_on says
// where they run).
//
// Rows of C per block for panels of NV vectors: as many accumulators as the registers hold
// beside B's row and a broadcast (AVX-512: 24 of 32 for whole panels; AVX2: 12 of 16 (with 6
// rows x 2 vectors GCC spilled a B vector: 1.4x MKL's time, AMD EPYC Zen 4)).
#if defined(__AVX512F__)
constexpr int kGemmVecs = 4;
constexpr int gemm_rows(int nv) { return nv == 4 ? 6 : 8; }
#else
constexpr int kGemmVecs = 3;
constexpr int gemm_rows(int nv) { return nv == 3 ? 4 : nv == 2 ? 5 : 8; }
#endif

// The blocks' loops over their registers unrolled whole, so the accumulators stay in registers
// (GCC otherwise kept them in memory: 2.3x MKL's time).
#if defined(__GNUC__)
#define RELPOS_PRAGMA(x) _Pragma(#x)
#define RELPOS_UNROLL RELPOS_PRAGMA(GCC unroll 8)
#else
#define RELPOS_UNROLL
#endif

// C[0 .. MR) x [0 .. NV · W) (the last vector's lanes cut to `last` where Tail) over k < K.
// Stream: B is read once from memory (a decode step's weight panels): its rows 32 ahead are
// prefetched.
template <int MR, int NV, bool Tail, bool Stream = false>
static RELPOS_INLINE void vec_gemm_block(int64_t K, const float* A, int64_t a_rs, int64_t a_ks,
                                         const float* B, int64_t ldb, float* C, int64_t ldc,
                                         float alpha, bool add, VecF::M last) {
  using V = VecF::V;
  constexpr int64_t W = VecF::W;
  const V zero = VecF::set1(0.0f);
  V acc[MR][NV];
  RELPOS_UNROLL for (int r = 0; r < MR; ++r) {
    RELPOS_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = zero;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    const float* a = A + k * a_ks;
    if constexpr (Stream) __builtin_prefetch(b + 32 * ldb);
    V bv[NV];
    RELPOS_UNROLL for (int v = 0; v < NV; ++v) {
      bv[v] = Tail && v == NV - 1 ? VecF::load_tail(b + v * W, last, zero) : VecF::load(b + v * W);
    }
    RELPOS_UNROLL for (int r = 0; r < MR; ++r) {
      const V ar = VecF::set1(a[r * a_rs]);
      RELPOS_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = VecF::fmadd(ar, bv[v], acc[r][v]);
    }
  }
  const V al = VecF::set1(alpha);
  RELPOS_UNROLL for (int r = 0; r < MR; ++r) {
    float* c = C + r * ldc;
    RELPOS_UNROLL for (int v = 0; v < NV; ++v) {
      // alpha · acc (+ C: one fused multiply-add, whatever the compiler contracts)
      if (Tail && v == NV - 1) {
        const V x = add ? VecF::fmadd(acc[r][v], al, VecF::load_tail(c + v * W, last, zero))
                        : VecF::mul(acc[r][v], al);
        VecF::store_tail(c + v * W, last, x);
      } else {
        const V x =
            add ? VecF::fmadd(acc[r][v], al, VecF::load(c + v * W)) : VecF::mul(acc[r][v], al);
        VecF::store(c + v * W, x);
      }
    }
  }
}

// The last `rows` (< MR) rows of a panel: one block of that many.
template <int MR, int NV, bool Tail>
static RELPOS_INLINE void vec_gemm_rest(int64_t rows, int64_t K, const float* A, int64_t a_rs,
                                        int64_t a_ks, const float* B, int64_t ldb, float* C,
                                        int64_t ldc, float alpha, bool add, VecF::M last) {
  if constexpr (MR > 1) {
    if (rows == MR - 1)
      vec_gemm_block<MR - 1, NV, Tail>(K, A, a_rs, a_ks, B, ldb, C, ldc, alpha, add, last);
    else
      vec_gemm_rest<MR - 1, NV, Tail>(rows, K, A, a_rs, a_ks, B, ldb, C, ldc, alpha, add, last);
  }
}

// All M rows of one panel of NV vectors, in blocks of gemm_rows(NV) rows.
template <int NV, bool Tail>
static void vec_gemm_panel(int64_t M, int64_t K, const float* A, int64_t a_rs, int64_t a_ks,
                           const float* B, int64_t ldb, float* C, int64_t ldc, float alpha,
                           bool add, VecF::M last) {
  constexpr int MR = gemm_rows(NV);
  int64_t i = 0;
  for (; i + MR <= M; i += MR)
    vec_gemm_block<MR, NV, Tail>(K, A + i * a_rs, a_rs, a_ks, B, ldb, C + i * ldc, ldc, alpha, add,
                                 last);
  vec_gemm_rest<MR, NV, Tail>(M - i, K, A + i * a_rs, a_rs, a_ks, B, ldb, C + i * ldc, ldc, alpha,
                              add, last);
}

// out (K, N; row stride ldo) = B^T for B (N, K) with row stride ldb, by blocks of W x W in
// vector registers (16 x 16 with AVX-512, 8 x 8 with AVX2), edge blocks through masked loads and
// stores.
static void transpose_into(const float* B, int64_t N, int64_t K, int64_t ldb, float* out,
                           int64_t ldo) {
  constexpr int64_t W = VecF::W;
  const VecF::V zero = VecF::set1(0.0f);
  for (int64_t n0 = 0; n0 < N; n0 += W) {
    const int64_t nn = std::min<int64_t>(W, N - n0);
    const VecF::M mn = VecF::tail(nn);
    for (int64_t k0 = 0; k0 < K; k0 += W) {
      const int64_t kk = std::min<int64_t>(W, K - k0);
      const VecF::M mk = VecF::tail(kk);
      VecF::V r[W];
      for (int64_t i = 0; i < W; ++i)
        r[i] = i < nn ? VecF::load_tail(B + (n0 + i) * ldb + k0, mk, zero) : zero;
#if defined(__AVX512F__)
      __m512i x[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_castps_si512(r[i]);
      transpose16(x);
      for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(x[i]);
#else
      __m256 t[8], u[8];
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
      }
#endif
      for (int64_t i = 0; i < kk; ++i) VecF::store_tail(out + (k0 + i) * ldo + n0, mn, r[i]);
    }
  }
}

// The last panel, of nv <= NV vectors (its last one cut to `last`).
template <int NV>
static void vec_gemm_tail_panel(int nv, int64_t M, int64_t K, const float* A, int64_t a_rs,
                                int64_t a_ks, const float* B, int64_t ldb, float* C, int64_t ldc,
                                float alpha, bool add, VecF::M last) {
  if (nv == NV)
    vec_gemm_panel<NV, true>(M, K, A, a_rs, a_ks, B, ldb, C, ldc, alpha, add, last);
  else if constexpr (NV > 1)
    vec_gemm_tail_panel<NV - 1>(nv, M, K, A, a_rs, a_ks, B, ldb, C, ldc, alpha, add, last);
}

static void vec_sgemm_run(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                          const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                          float* C, int64_t ldc) {
  constexpr int64_t W = VecF::W, P = kGemmVecs * W;
  const int64_t a_rs = ta ? 1 : lda, a_ks = ta ? lda : 1;
  if (tb) {  // B^T's rows padded to whole vectors on 64-byte lines (no load splits a line)
    thread_local std::vector<float> bt;  // each thread keeps its largest (K_J^T: 128 KiB at
                                         // 512 keys and D = 64)
    const int64_t ld = (N + W - 1) / W * W;
    if (static_cast<int64_t>(bt.size()) < K * ld + 16) bt.resize(K * ld + 16);
    float* out = bt.data() + (16 - reinterpret_cast<uintptr_t>(bt.data()) / 4 % 16) % 16;
    transpose_into(B, N, K, ldb, out, ld);
    B = out;
    ldb = ld;
  }
  const bool add = beta != 0.0f;
  int64_t n0 = 0;
  for (; n0 + P <= N; n0 += P)
    vec_gemm_panel<kGemmVecs, false>(M, K, A, a_rs, a_ks, B + n0, ldb, C + n0, ldc, alpha, add,
                                     VecF::tail(W));
  const int64_t rest = N - n0;
  if (rest == 0) return;
  const int nv = static_cast<int>((rest + W - 1) / W);
  const VecF::M last = VecF::tail(rest - (nv - 1) * W);
  const float* b = B + n0;
  float* c = C + n0;
  vec_gemm_tail_panel<kGemmVecs>(nv, M, K, A, a_rs, a_ks, b, ldb, c, ldc, alpha, add, last);
}
#endif  // RELPOS_VEC_FLOAT: end of the vector section

}  // namespace relpos_native
