// The libraries' GEMMs: the BLAS's sgemm_ and dgemm_ as libtorch exports them (MKL on x86;
// RELPOS_HAVE_BLAS), kept on the calling thread (SingleThreadedBlas); libtorch's own matrix
// multiply (gemm_aten); MKL's 16-bit GEMMs with float accumulation (low_gemm), where libtorch
// exports them. gemm.h chooses among these and the kernels' own engines.

#pragma once

#include "config.h"

#include <torch/extension.h>
#include <ATen/ops/addmm_cpu_dispatch.h>

namespace relpos_native {

#ifdef RELPOS_HAVE_BLAS
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
#if defined(__GNUC__)
// MKL's thread count for the calling thread only (libtorch's x86 builds export it): the C entry
// that mkl_service.h names mkl_set_num_threads_local (the lower-case symbol is the Fortran one,
// which takes a pointer). Weak: a libtorch whose BLAS lacks it still loads the kernels, which
// then leave the count alone.
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));
#endif
}
#endif

// Keeps the BLAS on the calling thread while it lives; each task of at::parallel_for holds one.
// Inside torch's OpenMP region MKL already does, but at::parallel_for runs a lone task (B = H =
// 1) inline, outside any region, where MKL would thread a GEMM itself and round it otherwise:
// with the guard a task computes the same bits at every thread count.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() {
#if defined(RELPOS_HAVE_BLAS) && defined(__GNUC__)
    if (MKL_Set_Num_Threads_Local != nullptr) {
      previous_ = MKL_Set_Num_Threads_Local(1);
      set_ = true;
    }
#endif
  }
  ~SingleThreadedBlas() {
#if defined(RELPOS_HAVE_BLAS) && defined(__GNUC__)
    if (set_) MKL_Set_Num_Threads_Local(previous_);  // 0: back to the global count
#endif
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int previous_ = 0;
  bool set_ = false;
};

// libtorch's own matrix multiply (at::cpu::addmm_out on the operands as strided tensors, no
// copy, past the dispatcher): the GEMM torch.mm runs, on whatever BLAS this libtorch was built
// with (MKL, OpenBLAS, Accelerate, Arm Compute Library through oneDNN, or ATen's own loops).
// The route where libtorch exports no sgemm_/dgemm_ (a wheel without MKL, as non-x86 ones
// are), and on request (RELPOS_NATIVE_BLAS=aten, read once per process) where it does.
template <typename T>
static void gemm_aten(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                      int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  // op(A) is (M, K): A itself is (K, M) with rows lda apart when read transposed.
  const at::Tensor a =
      at::from_blob(const_cast<T*>(A), {M, K},
                    ta ? std::vector<int64_t>{1, lda} : std::vector<int64_t>{lda, 1}, options);
  const at::Tensor b =
      at::from_blob(const_cast<T*>(B), {K, N},
                    tb ? std::vector<int64_t>{1, ldb} : std::vector<int64_t>{ldb, 1}, options);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, options);
  at::cpu::addmm_out(c, c, a, b, beta, alpha);  // beta == 0: C's old contents (even NaN) unread
}

// ------------------------------------------------------------------------------------------
// Half precision (bfloat16, float16) in the forward: q, k, v and out stay in their 16-bit type
// (I below; T is float). The four GEMMs (S = scale · Q_I K_J^T, QA = scale · Q_I aK^T,
// acc += P V_J, acc += Pb aV) run on 16-bit operands with float accumulation: MKL's
// cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32 as libtorch exports them (AVX-512-BF16,
// AVX512-FP16 or AMX where the CPU has them), with P and Pb rounded to the 16-bit type for the
// last two, as torch's flash kernel rounds P, and the tables in the 16-bit type (rounded from
// the float copies the call passes, which were that type). Everything else is float: QA, the
// bucket masses Pb, the online softmax and out's accumulator. Where libtorch has no such GEMM,
// Q_I, K_J and V_J are widened per tile and the float GEMMs serve. No full-size widened copy
// either way.

#if defined(RELPOS_HAVE_BLAS) && defined(__GNUC__)
extern "C" {
// MKL's CBLAS (LP64: int sizes; CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112)
void cblas_gemm_bf16bf16f32(int layout, int ta, int tb, int m, int n, int k, float alpha,
                            const uint16_t* A, int lda, const uint16_t* B, int ldb, float beta,
                            float* C, int ldc) __attribute__((weak));
void cblas_gemm_f16f16f32(int layout, int ta, int tb, int m, int n, int k, float alpha,
                          const uint16_t* A, int lda, const uint16_t* B, int ldb, float beta,
                          float* C, int ldc) __attribute__((weak));
}
#endif

// Whether the 16-bit type I has a GEMM with float accumulation here.
template <typename I>
static inline bool has_low_gemm() {
#if defined(RELPOS_HAVE_BLAS) && defined(__GNUC__)
  if constexpr (std::is_same_v<I, c10::BFloat16>) return cblas_gemm_bf16bf16f32 != nullptr;
  if constexpr (std::is_same_v<I, c10::Half>) return cblas_gemm_f16f16f32 != nullptr;
#endif
  return false;
}

// C (M, N) = alpha · op(A) @ op(B) + beta · C, A and B of the 16-bit type I on packed
// row-major matrices: op(A) = A (M, K) or, with ta, A^T for A (K, M); op(B) = B (K, N) or,
// with tb, B^T for B (N, K); C float. Only where has_low_gemm<I>().
template <typename I>
static inline void low_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                            const I* A, const I* B, float beta, float* C) {
#if defined(RELPOS_HAVE_BLAS) && defined(__GNUC__)
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // C = beta · C (the BLAS may not scale C for an empty sum)
    for (int64_t x = 0; x < M * N; ++x) C[x] = beta == 0.0f ? 0.0f : beta * C[x];
    return;
  }
  const auto* a = reinterpret_cast<const uint16_t*>(A);
  const auto* b = reinterpret_cast<const uint16_t*>(B);
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const int lda = ta ? m : k, ldb = tb ? k : n;
  const int op_a = ta ? 112 : 111, op_b = tb ? 112 : 111;
  if constexpr (std::is_same_v<I, c10::BFloat16>)
    cblas_gemm_bf16bf16f32(101, op_a, op_b, m, n, k, alpha, a, lda, b, ldb, beta, C, n);
  else
    cblas_gemm_f16f16f32(101, op_a, op_b, m, n, k, alpha, a, lda, b, ldb, beta, C, n);
#else
  TORCH_CHECK(false, "no 16-bit GEMM in this build");
#endif
}

}  // namespace relpos_native
