// libtorch's batch-reduce GEMM micro-kernels (at::native::cpublas::brgemm: oneDNN's ukernels,
// the GEMMs PyTorch's own CPU flash attention runs on) as an engine of the kernels' front: C (M,
// N) = alpha · op(A) @ op(B) + beta · C, row-major. brgemm computes A (M, K) @ B (K, N) (+ C)
// only, so an operand read transposed is transposed first into a thread's buffer, and alpha != 1
// scales the product; bfloat16 takes B in VNNI pairs (K / 2, N, 2), packed here (cpublas::pack
// packs only where the CPU has AMX).

#pragma once

#include "config.h"
#include "gemm_vec.h"

#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>

namespace relpos_native {

// Whether brgemm runs bfloat16 here: oneDNN's bfloat16 micro-kernels need AVX-512 (F, BW, VL,
// DQ: avx512_core) and libtorch's oneDNN switched on; libtorch refuses VNNI-packed operands
// otherwise.
static bool brgemm_bf16_serves() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return cpu && at::globalContext().userEnabledMkldnn();
#else
  return false;
#endif
}

// out (cols, rows) = in^T for in (rows, cols) with row stride ld.
template <typename X>
static void transpose_copy(const X* in, int64_t rows, int64_t cols, int64_t ld, X* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * ld + c];
}

static void transpose_float(const float* in, int64_t rows, int64_t cols, int64_t ld, float* out) {
#if defined(RELPOS_VEC_FLOAT)
  transpose_into(in, rows, cols, ld, out, rows);
#else
  transpose_copy(in, rows, cols, ld, out);
#endif
}

static void brgemm_float(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                         const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                         float* C, int64_t ldc) {
  thread_local std::vector<float> at_buf, bt_buf, c_buf;
  if (ta) {
    if (static_cast<int64_t>(at_buf.size()) < M * K) at_buf.resize(M * K);
    transpose_float(A, K, M, lda, at_buf.data());
    A = at_buf.data();
    lda = K;
  }
  if (tb) {
    if (static_cast<int64_t>(bt_buf.size()) < K * N) bt_buf.resize(K * N);
    transpose_float(B, N, K, ldb, bt_buf.data());
    B = bt_buf.data();
    ldb = N;
  }
  if (alpha == 1.0f) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, beta != 0.0f, A, B, C, false);
    return;
  }
  if (beta == 0.0f) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, false, A, B, C, false);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] *= alpha;
    return;
  }
  if (static_cast<int64_t>(c_buf.size()) < M * N) c_buf.resize(M * N);
  at::native::cpublas::brgemm(M, N, K, lda, ldb, N, false, A, B, c_buf.data(), false);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] += alpha * c_buf[i * N + j];
}

// bfloat16 operands, float C: A (M, K) row-major (or A^T of A (K, M) with ta), B (K, N) (or
// B^T of B (N, K) with tb), both packed (row stride = width); B goes to VNNI pairs, K padded to
// even with a zero row (and A with a zero column).
static void brgemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                        const c10::BFloat16* A, const c10::BFloat16* B, float beta, float* C) {
  thread_local std::vector<c10::BFloat16> a_buf, b_buf;
  thread_local std::vector<float> c_buf;
  const int64_t K2 = (K + 1) / 2 * 2;
  const c10::BFloat16* a = A;
  int64_t lda = K;
  if (ta || K2 != K) {
    if (static_cast<int64_t>(a_buf.size()) < M * K2) a_buf.resize(M * K2);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t k = 0; k < K; ++k) a_buf[i * K2 + k] = ta ? A[k * M + i] : A[i * K + k];
      if (K2 != K) a_buf[i * K2 + K] = c10::BFloat16(0.0f);
    }
    a = a_buf.data();
    lda = K2;
  }
  if (static_cast<int64_t>(b_buf.size()) < K2 * N) b_buf.resize(K2 * N);
  c10::BFloat16* bp = b_buf.data();
  for (int64_t k = 0; k < K2; k += 2)
    for (int64_t j = 0; j < N; ++j) {
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t kk = k + t;
        bp[(k / 2) * N * 2 + j * 2 + t] =
            kk >= K ? c10::BFloat16(0.0f) : (tb ? B[j * K + kk] : B[kk * N + j]);
      }
    }
  if (alpha == 1.0f) {
    at::native::cpublas::brgemm(M, N, K2, lda, N, N, beta != 0.0f, a, bp, C, true);
    return;
  }
  if (static_cast<int64_t>(c_buf.size()) < M * N) c_buf.resize(M * N);
  at::native::cpublas::brgemm(M, N, K2, lda, N, N, false, a, bp, c_buf.data(), true);
  for (int64_t x = 0; x < M * N; ++x) C[x] = (beta == 0.0f ? 0.0f : C[x]) + alpha * c_buf[x];
}

}  // namespace relpos_native
