// The BLAS: sgemm_ and dgemm_ as libtorch exports them (MKL on x86; RELPOS_HAVE_BLAS), kept on
// the calling thread (SingleThreadedBlas); libtorch's own matrix multiply (gemm_aten) where it
// exports no BLAS. gemm.h's blas_gemm calls them.

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
// are).
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

}  // namespace relpos_native
