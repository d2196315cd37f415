// relpos native CPU kernels: flash attention with Toeplitz buckets (DESIGN.md section 6).
//
// Exact clipped relative attention (Shaw et al., 2018), forward and backward, in one pass over
// the scores per direction, with O(L·R) extra state per head (R = left + right + 1 table rows),
// never O(L·S):
//
//   QA = scale * q @ aK^T                                         (L, R)
//   tile (query block I, key block J):
//     s_ij = scale * q_i . k_j + QA[i, r_ij] + bias_j             far keys add QA[i, 0] or QA[i, R-1]
//     online softmax (m_i, l_i), acc_i += p_ij v_j, Pb[i, r_ij] += p_ij
//   out_i = (acc_i + Pb_i @ aV) / l_i,  lse_i = m_i + log l_i
//
// Backward, with delta_i = dO_i . out_i and dOA = dO @ aV^T:
//   p_ij = exp(s_ij - lse_i), dp_ij = dO_i . v_j + dOA[i, r_ij], ds_ij = p_ij (dp_ij - delta_i)
//   dq = scale (dS @ K + dSb @ aK), dk = scale dS^T @ Q, dv = P^T @ dO,
//   daK = scale dSb^T @ q, daV = Pb^T @ dO         (dSb, Pb: per-row bucket sums of dS and P)
//
// Row i at position p = query_start + i splits each key block into three segments:
//   far-left  j <= p - left                 table row 0
//   band      p - left < j < p + right      table row j - p + left
//   far-right j >= p + right (and past the band)   table row R - 1
// Only the band gathers; the far segments add one constant per row.
//
// Attention dropout uses a counter-based hash of (seed, dropout row, key), so the backward
// regenerates the forward's mask and `dropout_mask` / `dropout_mask_varlen` expose it.
//
// Two layouts share the work of one head of one sequence (a task, given its Geometry: L, S,
// query_start, and its pointers): padded batches (B, H, L, D), whose tasks are (batch, head,
// query block) forward and (batch, head) backward; and packed variable-length batches
// ("varlen", flash-attention's layout): q (Tq, H, D), k and v (Tk, H, ·), sequence s the query
// rows [cu_q[s], cu_q[s+1]) and key rows [cu_k[s], cu_k[s+1]), each aligned bottom-right
// (query_start = S_s - L_s); with seqused_k (flash-attention's: a KV cache with spare capacity)
// sequence s uses only the first S_s = seqused_k[s] rows of its key region, the rest is never
// read and gets a zero gradient. Varlen tasks are (sequence, head, query block) forward and
// (sequence, head) backward, with each sequence's own block sizes; no work crosses sequences.
//
// Table gradients: one partial per (batch, head) task, reduced afterwards in a fixed order:
// deterministic whatever the thread count. dk and dv are owned by their (batch, head) task.
// Varlen: one partial per (group of consecutive sequences, head), the groups fixed by the
// sequence lengths alone (varlen_gradient_groups), so the same order at every thread count.
//
// GEMMs: MKL's sgemm_/dgemm_ as exported by libtorch (RELPOS_HAVE_BLAS; MKL runs on the task's
// thread, as in torch's own flash kernel, also for a lone task that at::parallel_for runs
// inline: SingleThreadedBlas); libtorch's own matrix multiply (at::cpu::addmm_out, whatever BLAS
// it was built with) where it exports none. float32 GEMMs on the kernels' own AVX-512 vectors
// where the build has them (vec_sgemm).
//
// The entry points release the GIL: nothing below them touches a Python object.
//
// The file, top down: block sizes; GEMM, exp and the dropout hash; the call's options and
// geometry, a head's pointers (padded and varlen); the row primitives; the phases of a row that
// both directions share (masks, band key term, exp by segment, bucket sums); the forward's
// phases (online-softmax step with its rescale, dropout and bucket update, epilogue), its task
// and the padded and varlen task loops; the backward's phases (delta, recompute P, NaN rows, dS
// by segment, bucket gradients, dQ/dK/dV and table-gradient GEMMs), its task and its task
// loops; the padded entry points; the varlen entry points. Each phase is one function, forced
// inline into the task that calls it, and each task into its loops, so the compiled loops are
// those of a single loop body.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm_cpu_dispatch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(_MSC_VER)
#define RELPOS_INLINE __forceinline
#else
#define RELPOS_INLINE inline __attribute__((always_inline))
#endif

namespace relpos_native {

using at::Tensor;

// ------------------------------------------------------------------------------------------
// Block sizes
//
// Measured (benchmarks/kernel_blocks.md; forward and forward + backward against SDPA, one and
// two threads, B x n from 64 x 64 to 1 x 4096): the forward runs faster with taller query blocks
// (each K/V tile and the table GEMMs serve more rows, MKL packs K_J^T once per 256 rows instead
// of per 64: 1 x 4096 went from 1.12x to 1.0x SDPA with the tables), so a forward block is 256
// rows, halved (down to 64) while the call would have fewer than kForwardTasks tasks, so that
// a call with few heads still spreads over the threads; the rule reads the shapes only, so the
// blocks (and the bits) are the same at every thread count. The backward holds two tiles (dP
// beside S) and runs best at 128 rows. The key block is torch's CPU flash kernel's 512: a
// 256 x 512 tile is 512 KiB of float scores.

constexpr int64_t kForwardQueryBlock = 256;   // rows of Q per forward block, at most
constexpr int64_t kMinForwardQueryBlock = 64; // ... and at least (unless L is shorter)
constexpr int64_t kForwardTasks = 64;         // halve the block while fewer tasks than this
constexpr int64_t kBackwardQueryBlock = 128;  // rows of Q per backward block
constexpr int64_t kKeyBlock = 512;            // keys per tile
// A decode step (at most kDecodeQueryRows queries) takes its whole rows in one key block of at
// most kDecodeScores scores, so its softmax never rescales (no measurement recorded).
constexpr int64_t kDecodeQueryRows = 8;
constexpr int64_t kDecodeScores = 65536;

// The forward's query block for L queries of `heads` (batch, head) or (sequence, head) pairs.
static int64_t forward_query_block(int64_t L, int64_t heads) {
  int64_t bq = kForwardQueryBlock;
  while (bq > kMinForwardQueryBlock && heads * ((L + bq - 1) / bq) < kForwardTasks) bq /= 2;
  return std::min<int64_t>(std::max<int64_t>(L, 1), bq);
}

static int64_t backward_query_block(int64_t L) {
  return std::min<int64_t>(std::max<int64_t>(L, 1), kBackwardQueryBlock);
}

static int64_t key_block_size(int64_t L, int64_t S) {
  if (L <= kDecodeQueryRows)
    return std::min<int64_t>(
        S, std::max<int64_t>(kKeyBlock, kDecodeScores / std::max<int64_t>(L, 1)));
  return std::min<int64_t>(S, kKeyBlock);
}

// ------------------------------------------------------------------------------------------
// GEMM: row-major C[M, N] = alpha * op(A)[M, K] @ op(B)[K, N] + beta * C

#ifdef RELPOS_HAVE_BLAS
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b,
            const int* ldb, const double* beta, double* c, const int* ldc);
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
  const at::Tensor a = at::from_blob(const_cast<T*>(A), {M, K},
                                     ta ? std::vector<int64_t>{1, lda}
                                        : std::vector<int64_t>{lda, 1}, options);
  const at::Tensor b = at::from_blob(const_cast<T*>(B), {K, N},
                                     tb ? std::vector<int64_t>{1, ldb}
                                        : std::vector<int64_t>{ldb, 1}, options);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, options);
  at::cpu::addmm_out(c, c, a, b, beta, alpha);  // beta == 0: C's old contents (even NaN) unread
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

// float32 GEMMs on the kernels' own vectors where the build has them (vec_sgemm, below):
// false where it leaves the call to the BLAS.
static bool vec_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                      const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                      float* C, int64_t ldc);

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
static inline void gemm_nn(int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B,
                           T beta, T* C) {
  gemm<T>(false, false, M, N, K, alpha, A, K, B, N, beta, C, N);
}

// C (M, N) = alpha · A (M, K) @ B^T + beta · C, B (N, K)
template <typename T>
static inline void gemm_nt(int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B,
                           T beta, T* C) {
  gemm<T>(false, true, M, N, K, alpha, A, K, B, K, beta, C, N);
}

// C (M, N) = alpha · A^T @ B (K, N) + beta · C, A (K, M)
template <typename T>
static inline void gemm_tn(int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B,
                           T beta, T* C) {
  gemm<T>(true, false, M, N, K, alpha, A, M, B, N, beta, C, N);
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

#if defined(__AVX512F__)
// r[i] = row i of a 16 x 16 matrix of 32-bit elements; afterwards r[i] = its column i (the
// bfloat16 tiles' packing and the float32 GEMMs' B^T).
static inline void transpose16(__m512i r[16]) {
  __m512i s[16];
  for (int i = 0; i < 8; ++i) {
    s[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    s[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(s[4 * i], s[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(s[4 * i], s[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(s[4 * i + 1], s[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(s[4 * i + 1], s[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      s[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      s[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(s[j], s[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(s[j], s[8 + j], 0xdd);
  }
}
#endif

// ------------------------------------------------------------------------------------------
// Tile GEMMs for bfloat16: the forward's four (S = scale · Q_I K_J^T, QA = scale · Q_I aK^T,
// acc += P V_J, acc += Pb aV) and the backward's five tile GEMMs (S, dP = dO_I V_J^T,
// dV_J += P^T dO_I, dq += dS K_J, dK_J += scale · dS^T Q_I) on operands packed by the kernels,
// where the build targets a CPU with AVX512-BF16 (-march=native on one, or the portable amx
// variant). MKL's bfloat16 GEMM repacks both operands on every call (a tenth of the forward at
// 8 x 512, perf); here each operand is packed once: Q and dO per query block, a head's K and V
// tiles once per head (AmxHeadTiles), dS (and P^T, dS^T) row by row as the backward's rows are
// done, into contiguous 16 x 32 bfloat16 tiles of 1 KiB (A as rows, B in the pair-interleaved
// layout TDPBF16PS and VDPBF16PS read), edges zero-filled, so any n, D and Dv run; the
// forward's P is written in bfloat16 by the softmax itself and its tiles read from those rows
// by stride. The products run on AMX tiles where the CPU has AMX-BF16 and Linux grants this
// process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once), else on the same packed tiles
// by VDPBF16PS (AMD Zen 4 and later, Intel Cooper Lake: each row of a 16 x 16 float tile a
// 16-lane accumulator, one dot product per pair of k with the row's pair broadcast). Both sum
// each pair of bfloat16 products into float32 accumulators (input denormals count as zero, as
// in MKL's kernels). Whole 2 x 2 blocks of 16 x 16 float tiles go straight to their float
// destination (stored, or loaded, accumulated and stored); edge tiles through a 1 KiB buffer,
// masked. A power-of-two scale (D = 64's 1/8) is applied exactly to Q as it is packed; another
// one to the tiles on their way out. P and dS are rounded to bfloat16 (nearest even), as MKL's
// path rounds them. bf16_gemm() below says which engine (or MKL's GEMM, or widened tiles) a
// call runs.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RELPOS_HAVE_BF16_TILES 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define RELPOS_HAVE_AMX 1
#endif
#endif

// Where a call's bfloat16 tile GEMMs run: MKL's GEMM on unpacked operands (kNoTiles), or on
// packed tiles, by AMX or by VDPBF16PS.
enum TileGemm : uint8_t { kNoTiles = 0, kAmxTiles = 1, kDotTiles = 2 };

// Whether this build has the AMX tile GEMMs and the OS lets this process use the tiles.
static bool amx_granted() {
#ifdef RELPOS_HAVE_AMX
  // ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

// Whether the CPU has AMX-BF16 (CPUID leaf 7: EDX bit 22), which MKL's bfloat16 GEMM then runs
// on (it asks the OS for the tiles itself).
static bool cpu_has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) != 0;
#else
  return false;
#endif
}

#ifdef RELPOS_HAVE_BF16_TILES
// Whether this core's VDPBF16PS gives more multiply-adds per second than its VFMADD231PS (a dot
// product does two per lane, an FMA one): both timed once, 12 independent accumulators, the
// best of 9 runs of each (about 0.2 ms, once per process). On Intel's Sapphire Rapids one
// VDPBF16PS takes 4x an FMA's time and the packed tiles' dot products ran the bfloat16 forward
// 1.25-1.45x the time of tiles widened to float32 for the FMA GEMMs
// (benchmarks/half_precision_engines.md); other cores (AMD's Zen 4 and 5 among them, not
// measured there) are for this timing to judge.
static bool dot_products_pay() {
  static const bool pays = [] {
    using clock = std::chrono::steady_clock;
    constexpr int kChains = 12, kSteps = 2000;
    __m512 acc[kChains];
    __m512 f = _mm512_set1_ps(1.0f), g = _mm512_set1_ps(0.0f);
    __m512bh x = (__m512bh)_mm512_set1_epi32(0);
    double best_dot = 1e30, best_fma = 1e30;
    for (int run = 0; run < 9; ++run) {
      for (int i = 0; i < kChains; ++i) {  // distinct and opaque: 12 chains, not one
        acc[i] = _mm512_set1_ps(static_cast<float>(i));
        __asm__ volatile("" : "+v"(acc[i]));
      }
      auto t0 = clock::now();
      for (int s = 0; s < kSteps; ++s) {
#pragma GCC unroll 12
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], f, g);
        __asm__ volatile("" : "+v"(f));
      }
      auto t1 = clock::now();
      for (int s = 0; s < kSteps; ++s) {
#pragma GCC unroll 12
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, x);
        __asm__ volatile("" : "+v"(x));
      }
      auto t2 = clock::now();
      for (int i = 0; i < kChains; ++i) __asm__ volatile("" : : "v"(acc[i]));
      best_fma = std::min(best_fma, std::chrono::duration<double>(t1 - t0).count());
      best_dot = std::min(best_dot, std::chrono::duration<double>(t2 - t1).count());
    }
    return best_dot < 2.0 * best_fma;
  }();
  return pays;
}
#endif

// What bfloat16 calls run their 16-bit GEMMs on: AMX tiles, VDPBF16PS on the same packed tiles,
// MKL's cblas_gemm_bf16bf16f32, or none (kWidened: tiles widened to float32 for the float
// GEMMs, P and dS unrounded).
enum class Bf16Gemm : uint8_t { kWidened, kMkl, kAmx, kDot };

static std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// The choice for this call. By default: AMX where this build has it and the OS grants it; else
// VDPBF16PS where this build has it and it pays (dot_products_pay); else MKL's GEMM where the CPU
// has AMX-BF16 (a portable build on such a CPU: MKL runs it on the tiles); else widened tiles
// (MKL's bfloat16 GEMM without AMX took 1.06-1.51x their time with MKL held to AVX2, AVX-512 or
// AVX512-BF16, benchmarks/half_precision_engines.md). RELPOS_NATIVE_BF16_GEMM=amx,
// avx512bf16, mkl or widened asks for one (one this build or CPU lacks gives way to the next in
// that order); without it RELPOS_NATIVE_HALF_GEMM=0 asks for widened, then RELPOS_NATIVE_AMX=0
// (older) for mkl, RELPOS_NATIVE_HALF_GEMM=1 for the first 16-bit GEMM there is (amx,
// avx512bf16, mkl). MKL's bfloat16 GEMM must exist for any of them (the tile GEMMs' short
// blocks run on it).
static Bf16Gemm bf16_gemm() {
  const std::string want = env_or_empty("RELPOS_NATIVE_BF16_GEMM");
  TORCH_CHECK(want.empty() || want == "amx" || want == "avx512bf16" || want == "mkl" ||
                  want == "widened",
              "relpos native: RELPOS_NATIVE_BF16_GEMM must be amx, avx512bf16, mkl or widened "
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
// a CPU with AVX512-FP16 (benchmarks/half_precision.md), and CPUs without FP16 arithmetic can
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
    return {e != Bf16Gemm::kWidened,
            e == Bf16Gemm::kAmx ? kAmxTiles : e == Bf16Gemm::kDot ? kDotTiles : kNoTiles};
  }
  return {env_or_empty("RELPOS_NATIVE_HALF_GEMM") == "1", kNoTiles};
}

constexpr int64_t kTileElems = 512;  // bfloat16 elements of one 16 x 32 tile (1 KiB)

// 16-row (or 16-column) tiles covering n, rounded up to an even count (the GEMM's 2 x 2 blocks).
static inline int64_t amx_tiles_of(int64_t n) { return (n + 31) / 32 * 2; }
static inline int64_t amx_kblocks(int64_t k) { return (k + 31) / 32; }

// The bit patterns of a 16-bit tensor's elements (the AMX packers read them as such).
template <typename I>
static inline const uint16_t* bits_of(const I* x) {
  static_assert(sizeof(I) == 2, "16-bit types only");
  return reinterpret_cast<const uint16_t*>(x);
}

// A 64-byte-aligned bfloat16 buffer of n elements (zeros).
struct AmxBuffer {
  std::vector<uint16_t> raw;
  uint16_t* p = nullptr;
  void resize(int64_t n) {
    raw.assign(n + 32, 0);
    const auto addr = reinterpret_cast<uintptr_t>(raw.data());
    p = raw.data() + ((64 - addr % 64) % 64) / 2;
  }
};

// A packed input operand (K_J, V_J or a table) and which rows it holds: packed again only for
// other rows. A thread's state lives for one call, whose inputs do not change, so the same rows
// pack the same: the next query block of a head reuses its single key tile, every block of a
// call the shared tables.
struct AmxOperand {
  AmxBuffer buf;
  const void* src = nullptr;
  int64_t rows = -1;
  bool holds(const void* from, int64_t n) const { return src == from && rows == n; }
  void mark(const void* from, int64_t n) {
    src = from;
    rows = n;
  }
};

// A head's key tiles (K_J or V_J) packed as one operand each, on first use, and kept for the
// head's other query blocks (packing them again for every query block, as MKL's GEMM does on
// every call, cost a twentieth of the forward at n = 4096). Tile t (keys t·BK ..) in slot t of
// `slot` elements, packed from its first min(BK, S - t·BK) rows. Keyed by the head's rows (src,
// S) and the slot: a thread's state lives for one call, whose inputs do not change.
struct AmxHeadTiles {
  AmxBuffer buf;
  int64_t capacity = 0;
  const void* src = nullptr;
  int64_t S = -1, BK = 0, slot = 0;
  std::vector<uint8_t> done;
  // The slot of the tile starting at key j0, packed by pack(slot pointer) unless it is already.
  template <typename Pack>
  const uint16_t* tile(const void* from, int64_t S_, int64_t BK_, int64_t slot_, int64_t j0,
                       Pack&& pack) {
    if (from != src || S_ != S || BK_ != BK || slot_ != slot) {
      const int64_t tiles = (S_ + BK_ - 1) / BK_;
      if (capacity < tiles * slot_) {
        buf.resize(tiles * slot_);
        capacity = tiles * slot_;
      }
      src = from;
      S = S_;
      BK = BK_;
      slot = slot_;
      done.assign(tiles, 0);
    }
    uint16_t* p = buf.p + (j0 / BK) * slot;
    if (!done[j0 / BK]) {
      pack(p);
      done[j0 / BK] = 1;
    }
    return p;
  }
};

#ifdef RELPOS_HAVE_BF16_TILES

#ifdef RELPOS_HAVE_AMX
static inline void amx_configure() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}
#endif

// A operand: rows of a (M, K; row stride ld) as row tiles: element (r, c) of row tile t and
// k-block b at out[(t · KB + b) · 512 + (r % 16) · 32 + c % 32]; zeros past M and K; times a
// power of two `scale` where it is not 1 (exact: the bfloat16 values scaled, not rounded).
static void amx_pack_rows(const uint16_t* a, int64_t M, int64_t K, int64_t ld, uint16_t* out,
                          float scale = 1.0f) {
  const int64_t KB = amx_kblocks(K), MT = amx_tiles_of(M);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < MT * 16; ++r) {
    uint16_t* row = out + (r / 16) * KB * kTileElems + (r % 16) * 32;
    for (int64_t b = 0; b < KB; ++b) {
      const int64_t n = r < M ? std::min<int64_t>(32, K - b * 32) : 0;
      const __mmask32 m = n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
      __m512i x = _mm512_maskz_loadu_epi16(m, r < M ? a + r * ld + b * 32 : a);
      if (scale != 1.0f) {  // bfloat16 -> float: the 16 bits on top of a zero half
        const __m512 lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(x)), 16));
        const __m512 hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(x, 1)), 16));
        x = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, sc), _mm512_mul_ps(lo, sc));
      }
      _mm512_storeu_si512(row + b * kTileElems, x);
    }
  }
}

// Whether x is a power of two (scaling by it is exact in floating point, range permitting).
static inline bool power_of_two(float x) {
  int e = 0;
  return x > 0.0f && std::isfinite(x) && std::frexp(x, &e) == 0.5f;
}

// Row r of the A operand of float rows (M, K), rounded to bfloat16 (nearest even): x its K
// floats, or zeros for a row past M (x null).
static inline void amx_pack_row(const float* x, int64_t K, int64_t r, uint16_t* out) {
  const int64_t KB = amx_kblocks(K);
  uint16_t* row = out + (r / 16) * KB * kTileElems + (r % 16) * 32;
  if (x == nullptr) {
    for (int64_t b = 0; b < KB; ++b)
      _mm512_storeu_si512(row + b * kTileElems, _mm512_setzero_si512());
    return;
  }
  for (int64_t b = 0; b < KB; ++b) {
    const int64_t n = std::min<int64_t>(32, K - b * 32);
    const int64_t n0 = std::min<int64_t>(n, 16), n1 = std::max<int64_t>(n - 16, 0);
    const __mmask16 m0 = n0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n0) - 1);
    const __mmask16 m1 = n1 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n1) - 1);
    const __m512 lo = _mm512_maskz_loadu_ps(m0, x + b * 32);
    const __m512 hi = _mm512_maskz_loadu_ps(m1, x + b * 32 + 16);
    _mm512_storeu_si512(row + b * kTileElems, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// The zero rows past M of the A operand of float rows (M, K) (amx_pack_row's).
static inline void amx_pack_row_padding(int64_t M, int64_t K, uint16_t* out) {
  for (int64_t r = M; r < amx_tiles_of(M) * 16; ++r) amx_pack_row(nullptr, K, r, out);
}

// The same from float rows (P, Pb, dS), rounded to bfloat16 (nearest even).
static void amx_pack_rows(const float* a, int64_t M, int64_t K, int64_t ld, uint16_t* out) {
  for (int64_t r = 0; r < M; ++r) amx_pack_row(a + r * ld, K, r, out);
  amx_pack_row_padding(M, K, out);
}

// A operand of x^T for float rows x (M, K; row stride K), rounded to bfloat16: row tile t of
// x^T (columns 16t.. of x), k-block b (rows 32b.. of x); zeros past K and M. (P^T and dS^T.)
// Only k-block `only` where it is not -1 (rows 32 · only ..: packed as soon as they are done).
static void amx_pack_rows_t(const float* x, int64_t M, int64_t K, uint16_t* out,
                            int64_t only = -1) {
  const int64_t KB = amx_kblocks(M), MT = amx_tiles_of(K);
  for (int64_t t = 0; t < MT; ++t) {
    const int64_t c0 = t * 16, nc = std::max<int64_t>(0, std::min<int64_t>(16, K - c0));
    const __mmask16 m = nc >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
    for (int64_t b = only < 0 ? 0 : only; b < (only < 0 ? KB : only + 1); ++b) {
      __m512i half[2][16];
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 16; ++i) {
          const int64_t row = b * 32 + h * 16 + i;
          half[h][i] = row < M && nc > 0
                           ? _mm512_castps_si512(_mm512_maskz_loadu_ps(m, x + row * K + c0))
                           : _mm512_setzero_si512();
        }
        transpose16(half[h]);
      }
      uint16_t* tile = out + (t * KB + b) * kTileElems;
      for (int r = 0; r < 16; ++r)
        _mm512_storeu_si512(tile + r * 32,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(half[1][r]),
                                                         _mm512_castsi512_ps(half[0][r])));
    }
  }
}

// B operand from the rows of b (N, K; row stride K), as for C = A @ b^T: column tile t, k-block
// c holds, in row p, the pairs (b[n, 32c + 2p], b[n, 32c + 2p + 1]) of its 16 columns n; zeros
// past N and K. With K even each pair is one 32-bit word: 16 x 16 word transposes.
static void amx_pack_transposed(const uint16_t* b, int64_t N, int64_t K, uint16_t* out) {
  const int64_t KB = amx_kblocks(K), NT = amx_tiles_of(N);
  for (int64_t t = 0; t < NT; ++t) {
    for (int64_t c = 0; c < KB; ++c) {
      uint16_t* tile = out + (t * KB + c) * kTileElems;
      const int64_t n0 = t * 16, k0 = c * 32;
      if (K % 2 == 0 && n0 + 16 <= N && k0 + 32 <= K) {
        __m512i r[16];
        const auto* src = reinterpret_cast<const uint32_t*>(b + n0 * K + k0);
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * (K / 2));
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + i * 32, r[i]);
        continue;
      }
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t n = 0; n < 16; ++n)
          for (int64_t e = 0; e < 2; ++e) {
            const int64_t row = n0 + n, col = k0 + 2 * p + e;
            tile[p * 32 + 2 * n + e] = row < N && col < K ? b[row * K + col] : uint16_t(0);
          }
    }
  }
}

// B operand from b (K, N; row stride N), as for C = A @ b: column tile t, k-block c holds, in
// row p, the pairs (b[32c + 2p, n], b[32c + 2p + 1, n]) of its 16 columns n; zeros past K, N;
// times a power of two `scale` where it is not 1 (exact).
static void amx_pack_pairs(const uint16_t* b, int64_t K, int64_t N, uint16_t* out,
                           float scale = 1.0f) {
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t KB = amx_kblocks(K), NT = amx_tiles_of(N);
  // lanes 2n, 2n + 1 of the result: element n of the first row, element n of the second
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                      21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                      11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(interleave);
  for (int64_t t = 0; t < NT; ++t) {
    const int64_t n0 = t * 16, nn = std::max<int64_t>(0, std::min<int64_t>(16, N - n0));
    const __mmask16 m = nn >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nn) - 1);
    for (int64_t c = 0; c < KB; ++c) {
      uint16_t* tile = out + (t * KB + c) * kTileElems;
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t k = c * 32 + 2 * p;
        const __m256i r0 = k < K && nn > 0 ? _mm256_maskz_loadu_epi16(m, b + k * N + n0)
                                           : _mm256_setzero_si256();
        const __m256i r1 = k + 1 < K && nn > 0
                               ? _mm256_maskz_loadu_epi16(m, b + (k + 1) * N + n0)
                               : _mm256_setzero_si256();
        __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
        if (scale != 1.0f) {  // bfloat16 -> float (the 16 bits on top), scaled, back
          const __m512 f0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r0), 16));
          const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r1), 16));
          both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(f1, sc), _mm512_mul_ps(f0, sc));
        }
        _mm512_storeu_si512(tile + p * 32, _mm512_permutexvar_epi16(idx, both));
      }
    }
  }
}

// acc[i][c] += rows i = 0..7 of the A tile rows at ag (row stride a_row, k-block x at
// ag + x · a_next) times column tile c of B (b0, b1; KB k-blocks), by VDPBF16PS: each A pair
// broadcast to every lane, each B tile row a pair per column. kTwo false: column tile 0 only.
template <bool kTwo>
static inline void dot_rows(const uint16_t* ag, int64_t a_row, int64_t a_next, const uint16_t* b0,
                            const uint16_t* b1, int64_t KB, __m512 (&acc)[8][2]) {
  for (int64_t x = 0; x < KB; ++x) {
    const uint16_t* ax = ag + x * a_next;
    const uint16_t* bx0 = b0 + x * kTileElems;
    const uint16_t* bx1 = b1 + x * kTileElems;
#pragma GCC unroll 2
    for (int p = 0; p < 16; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(bx0 + p * 32);
      const __m512bh w1 = kTwo ? (__m512bh)_mm512_loadu_si512(bx1 + p * 32) : w0;
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        int32_t pair;  // (A[row, 2p], A[row, 2p + 1]), broadcast to every lane
        std::memcpy(&pair, ax + i * a_row + 2 * p, sizeof pair);
        const __m512bh s = (__m512bh)_mm512_set1_epi32(pair);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], s, w0);
        if (kTwo) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], s, w1);
      }
    }
  }
}

// C (M, N) = A @ B on packed operands (amx_pack_rows, amx_pack_transposed / amx_pack_pairs,
// KB k-blocks each), by 2 x 2 blocks of 16 x 16 float tiles; emit(row0, col0, tile) receives
// each tile inside C (row0, col0 its first row and column; tile 16 x 16, row stride 16).
// With `direct` (C itself, row stride N), whole blocks are stored there from the tiles (and,
// with `accumulate`, start from it: C += A @ B), and only the edges go through emit.
// With lda (> 0), A is bfloat16 rows of stride lda instead (its tiles read with that stride):
// every row of its 16-row tiles readable, finite past the row count (those rows' products are
// never emitted), zeros from column K on (lda >= 32 KB). On AMX tiles (engine kAmxTiles) or
// by VDPBF16PS (kDotTiles).
template <typename Emit>
static void tile_gemm(TileGemm engine, int64_t M, int64_t N, int64_t KB, const uint16_t* a,
                      const uint16_t* b, Emit&& emit, float* direct = nullptr,
                      bool accumulate = false, int64_t lda = 0) {
  alignas(64) float c[4][256];
  const int64_t MT = amx_tiles_of(M), NT = amx_tiles_of(N), step = KB * kTileElems;
  // A's tile (16 rows, k-block x) at a0 + x * a_next, its rows a_row elements apart
  const int64_t a_tile = lda > 0 ? 16 * lda : step, a_next = lda > 0 ? 32 : kTileElems;
  const int64_t a_row = lda > 0 ? lda : 32;
#ifdef RELPOS_HAVE_AMX
  const bool amx = engine == kAmxTiles;
  const int64_t ldc = N * static_cast<int64_t>(sizeof(float));
  if (amx) amx_configure();
#else
  (void)engine;
#endif
  for (int64_t mt = 0; mt < MT; mt += 2) {
    const uint16_t* a0 = a + mt * a_tile;
    const uint16_t* a1 = a0 + a_tile;
    for (int64_t nt = 0; nt < NT; nt += 2) {
      const uint16_t* b0 = b + nt * step;
      const uint16_t* b1 = b0 + step;
      float* whole = direct != nullptr && (mt + 2) * 16 <= M && (nt + 2) * 16 <= N
                         ? direct + mt * 16 * N + nt * 16
                         : nullptr;
#ifdef RELPOS_HAVE_AMX
      if (amx) {
        if (whole != nullptr && accumulate) {
          _tile_loadd(0, whole, ldc);
          _tile_loadd(1, whole + 16, ldc);
          _tile_loadd(2, whole + 16 * N, ldc);
          _tile_loadd(3, whole + 16 * N + 16, ldc);
        } else {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        const int64_t a_stride = a_row * 2;
        for (int64_t x = 0; x < KB; ++x) {
          _tile_loadd(4, a0 + x * a_next, a_stride);
          _tile_loadd(5, a1 + x * a_next, a_stride);
          _tile_loadd(6, b0 + x * kTileElems, 64);
          _tile_loadd(7, b1 + x * kTileElems, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        if (whole != nullptr) {
          _tile_stored(0, whole, ldc);
          _tile_stored(1, whole + 16, ldc);
          _tile_stored(2, whole + 16 * N, ldc);
          _tile_stored(3, whole + 16 * N + 16, ldc);
          continue;
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
      } else
#endif
      {
        // the block's 32 rows in four groups of 8, each row's 32 columns in two accumulators;
        // groups past M and a second column tile past N are not computed (those rows and
        // columns are never emitted)
        const bool two = (nt + 1) * 16 < N;
        for (int64_t grp = 0; grp < 4; ++grp) {
          if ((mt + grp / 2) * 16 + (grp % 2) * 8 >= M) continue;
          const uint16_t* ag = (grp < 2 ? a0 : a1) + (grp % 2) * 8 * a_row;
          float* out = whole != nullptr ? whole + grp * 8 * N : nullptr;
          __m512 acc[8][2];
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            const bool load = out != nullptr && accumulate;
            acc[i][0] = load ? _mm512_loadu_ps(out + i * N) : _mm512_setzero_ps();
            acc[i][1] = load ? _mm512_loadu_ps(out + i * N + 16) : _mm512_setzero_ps();
          }
          if (two)
            dot_rows<true>(ag, a_row, a_next, b0, b1, KB, acc);
          else
            dot_rows<false>(ag, a_row, a_next, b0, b1, KB, acc);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            if (out != nullptr) {
              _mm512_storeu_ps(out + i * N, acc[i][0]);
              _mm512_storeu_ps(out + i * N + 16, acc[i][1]);
            } else {  // tiles c[2 · (row tile) + (column tile)], rows of 16
              const int64_t row = (grp % 2) * 8 + i, q = (grp / 2) * 2;
              _mm512_store_ps(c[q] + row * 16, acc[i][0]);
              _mm512_store_ps(c[q + 1] + row * 16, acc[i][1]);
            }
          }
        }
        if (whole != nullptr) continue;
      }
      for (int q = 0; q < 4; ++q) {
        const int64_t row0 = (mt + q / 2) * 16, col0 = (nt + q % 2) * 16;
        if (row0 < M && col0 < N) emit(row0, col0, c[q]);
      }
    }
  }
#ifdef RELPOS_HAVE_AMX
  if (amx) _tile_release();
#endif
}

// The mask of the columns of C (M, N) in the tile whose first column is col0.
static inline __mmask16 amx_tile_columns(int64_t col0, int64_t N) {
  const int64_t n = std::min<int64_t>(16, N - col0);
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// c (M, N; row stride N) = scale · A @ B, or with accumulate c += scale · A @ B (one rounding:
// a fused multiply-add); with scale 1 whole blocks go straight between c and the tiles.
static void tile_gemm_into(TileGemm engine, int64_t M, int64_t N, int64_t KB, float scale,
                           const uint16_t* a, const uint16_t* b, float* c, bool accumulate,
                           int64_t lda = 0) {
  const __m512 sc = _mm512_set1_ps(scale);
  const bool unit = scale == 1.0f;
  tile_gemm(
      engine, M, N, KB, a, b,
      [&](int64_t row0, int64_t col0, const float* tile) {
        const __mmask16 m = amx_tile_columns(col0, N);
        const int64_t rows = std::min<int64_t>(16, M - row0);
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = c + (row0 + r) * N + col0;
          const __m512 t = _mm512_load_ps(tile + r * 16);
          __m512 v = unit ? t : _mm512_mul_ps(sc, t);
          if (accumulate) {
            const __m512 prev = _mm512_maskz_loadu_ps(m, dst);
            v = unit ? _mm512_add_ps(prev, t) : _mm512_fmadd_ps(sc, t, prev);
          }
          _mm512_mask_storeu_ps(dst, m, v);
        }
      },
      unit ? c : nullptr, accumulate, lda);
}

static inline void tile_gemm_scaled(TileGemm engine, int64_t M, int64_t N, int64_t KB,
                                    float scale, const uint16_t* a, const uint16_t* b, float* s) {
  tile_gemm_into(engine, M, N, KB, scale, a, b, s, false);
}

static inline void tile_gemm_add(TileGemm engine, int64_t M, int64_t N, int64_t KB,
                                 const uint16_t* a, const uint16_t* b, float* acc,
                                 float scale = 1.0f, int64_t lda = 0) {
  tile_gemm_into(engine, M, N, KB, scale, a, b, acc, true, lda);
}

// The packed B operand of key tile J (keys j0 .. of a head's S rows `head`, K wide) transposed,
// as for A @ K_J^T (scores, dP), from the head's cache. A tile the causal mask cuts to fewer
// keys uses the same packing: its further columns are computed and never stored.
template <typename I>
static inline const uint16_t* amx_head_tile_transposed(AmxHeadTiles& cache, const I* head,
                                                       int64_t S, int64_t BK, int64_t j0,
                                                       int64_t K) {
  const int64_t n = std::min(BK, S - j0);
  return cache.tile(head, S, BK, amx_tiles_of(BK) * amx_kblocks(K) * kTileElems, j0,
                    [&](uint16_t* p) { amx_pack_transposed(bits_of(head + j0 * K), n, K, p); });
}

// The same as pairs, as for A @ V_J (P @ V, dS @ K), for a tile of all its nk = min(BK, S - j0)
// keys; nullptr for a tile cut shorter, which the caller packs alone: there A's zero columns
// past nk must meet zero rows (the keys past nk, which may hold anything, are not read).
template <typename I>
static inline const uint16_t* amx_head_tile_pairs(AmxHeadTiles& cache, const I* head, int64_t S,
                                                  int64_t BK, int64_t j0, int64_t nk,
                                                  int64_t N) {
  const int64_t n = std::min(BK, S - j0);
  if (nk != n) return nullptr;
  return cache.tile(head, S, BK, amx_tiles_of(N) * amx_kblocks(BK) * kTileElems, j0,
                    [&](uint16_t* p) { amx_pack_pairs(bits_of(head + j0 * N), n, N, p); });
}
#endif  // RELPOS_HAVE_BF16_TILES

// dst[j] = src[j] in another floating type (rounded to nearest even where it narrows).
template <typename From, typename To>
static inline void convert(const From* src, To* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<To>(static_cast<float>(src[j]));
}

// ------------------------------------------------------------------------------------------
// exp: a vectorizable exp for float (Cody-Waite reduction, degree-7 polynomial; relative error
// about 2 ulp), exact std::exp for double. exp(-inf) = 0 and exp of anything below the float
// range is 0, at full speed (no slow underflow path); exp(+inf) = +inf, exp(NaN) = NaN.

static inline float exp_float(float x) {
  // NaN passes through the clamps and the polynomial (y is NaN, so is y * scale); the exponent
  // arithmetic below is unsigned, so its bits (garbage for NaN) are well-defined too.
  const float hi = 88.3762626647949f, lo = -87.3365447504019f;
  const bool under = x < lo;  // -inf included
  const float inf = std::numeric_limits<float>::infinity();
  const bool over = x == inf;  // the clamp below would saturate it at exp(hi)
  x = std::min(std::max(x, lo), hi);
  // Round x * log2(e) to the nearest integer n with the 1.5 * 2^23 trick (vectorizes; no
  // call to roundf): the low bits of t hold n.
  const float magic = 12582912.0f;
  const float t = x * 1.44269504088896341f + magic;
  const float n = t - magic;
  uint32_t tb;
  std::memcpy(&tb, &t, sizeof(tb));
  const uint32_t ni = tb - 0x4B400000u;  // n modulo 2^32 (0x4B400000: the bits of 1.5 * 2^23)
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  // 2^n as a float: the biased exponent n + 127 (1..255 for finite x) in bits 23..30.
  const uint32_t e = (ni + 127u) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  const float out = y * scale;
  return under ? 0.0f : over ? inf : out;
}

template <typename T>
static inline T exp_(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_float(x);
  } else {
    return std::exp(x);
  }
}

// ------------------------------------------------------------------------------------------
// Dropout: a counter-based hash (two rounds of murmur3's finalizer per element, a 64-bit mix
// per row), so forward, backward and `dropout_mask` produce the same keep mask. Row numbers:
// (b * H + h) * L + i for query i of head (b, h) of a padded call, h * Tq + cu_q[s] + i for
// query i of sequence s of a varlen call (Tq: all the call's queries); the key index j is the
// key's within its batch row or sequence.

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

struct Dropout {
  bool on = false;
  uint64_t seed0 = 0, seed1 = 0;
  uint32_t threshold = 0;  // keep iff hash >= threshold
  double inv_keep = 1.0;

  // Placement (a seed of five int64): the dropout rows and keys of a call that computes one
  // piece of a larger attention (context parallelism) are the larger call's: query i of head
  // bh is row bh * rows_per_head + row_offset + i, key j is key key_offset + j. Without it
  // (two int64): row bh * L + i, key j.
  bool placed = false;
  int64_t rows_per_head = 0, row_offset = 0, key_offset = 0;

  Dropout(double p, const c10::optional<Tensor>& seed) {
    if (p > 0.0) {
      TORCH_CHECK(seed.has_value() && (seed->numel() == 2 || seed->numel() == 5) &&
                      seed->scalar_type() == at::kLong,
                  "dropout needs a seed tensor of two int64 (or five: seed, then rows per "
                  "head, row offset, key offset)");
      auto s = seed->contiguous();
      const int64_t* sp = s.data_ptr<int64_t>();
      seed0 = static_cast<uint64_t>(sp[0]);
      seed1 = static_cast<uint64_t>(sp[1]);
      if (s.numel() == 5) {
        TORCH_CHECK(sp[2] >= 0 && sp[3] >= 0 && sp[4] >= 0,
                    "a dropout placement needs rows per head, row offset and key offset >= 0, "
                    "got ", sp[2], ", ", sp[3], ", ", sp[4]);
        placed = true;
        rows_per_head = sp[2];
        row_offset = sp[3];
        key_offset = sp[4];
      }
      on = true;
      const double t = std::ldexp(p, 32);
      threshold = t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
      inv_keep = 1.0 / (1.0 - p);
    }
  }

  // The dropout row of query 0 of head bh of a padded call of L queries.
  inline int64_t first_row(int64_t bh, int64_t L) const {
    return placed ? bh * rows_per_head + row_offset : bh * L;
  }

  // The two 32-bit keys of dropout row `row`.
  inline void row_keys(int64_t row, uint32_t& k1, uint32_t& k2) const {
    const uint64_t z = mix64(seed0 ^ mix64(seed1 + static_cast<uint64_t>(row) *
                                                      0x9E3779B97F4A7C15ULL));
    k1 = static_cast<uint32_t>(z);
    k2 = static_cast<uint32_t>(z >> 32);
  }

  static inline bool keep(uint32_t j, uint32_t k1, uint32_t k2, uint32_t threshold) {
    uint32_t h = fmix32((j * 0x9E3779B1u) ^ k1);
    h = fmix32(h + k2);
    return h >= threshold;
  }
};

// ------------------------------------------------------------------------------------------
// The call: its scalar options (relpos.ops.native.op builds them once per set of values) and
// the problem geometry derived from them and the tensors' shapes.

struct AttentionOptions {
  int64_t left = 0, right = 0;  // offsets clipped to [-left, +right]; table row r + left
  bool is_causal = false;
  double scale = 1.0;           // multiplies q . k and q . aK alike
  int64_t query_start = 0;      // position of query 0 (bottom-right alignment: S - L)
  double dropout_p = 0.0;       // attention dropout; its stream is the `seed` tensor
};

// Where row i (position p = query_start + i) meets key block [j0, j1): far-left [j0, fl), band
// [fl, bd), far-right [bd, end); the causal mask hides [end, j1). The row's tile entries are
// indexed from j0, so its far-left scores start at 0, its band at n_left, its far-right at
// n_left + n_band.
struct RowSegments {
  int64_t p, j0, fl, bd, end;
  int64_t n_left, n_band, n_right, n_visible;  // fl - j0, bd - fl, end - bd, end - j0
  int64_t band_row;                            // table row of key fl: fl - p + left
};

struct Geometry {
  int64_t B, H, L, S, D, Dv, R, left, right, query_start, Hr_k, Hr_v;
  bool causal;
  // A dense additive mask (B, H, L, S) in any strides (0 where broadcast), or none.
  int64_t mB = 0, mH = 0, mL = 0, mS = 0;

  // The segments of the row at position p within key block [j0, j1).
  inline RowSegments segments(int64_t p, int64_t j0, int64_t j1) const {
    RowSegments seg;
    seg.p = p;
    seg.j0 = j0;
    seg.end = causal ? std::min(j1, p + 1) : j1;
    if (seg.end < j0) seg.end = j0;
    seg.fl = std::min(std::max(p - left + 1, j0), seg.end);
    seg.bd = std::min(std::max(p + right, seg.fl), seg.end);
    seg.n_left = seg.fl - j0;
    seg.n_band = seg.bd - seg.fl;
    seg.n_right = seg.end - seg.bd;
    seg.n_visible = seg.end - j0;
    seg.band_row = left - p + seg.fl;
    return seg;
  }

  // Whether any row of query block [i0, i1) sees a key of the block starting at j0.
  inline bool block_visible(int64_t i1, int64_t j0) const {
    return !causal || j0 <= query_start + i1 - 1;
  }

  // End of the key block starting at j0: BK keys, cut where the causal mask hides the rest
  // from every row of the query block ending at i1 (so the GEMMs skip the hidden triangle).
  inline int64_t block_end(int64_t i1, int64_t j0, int64_t BK) const {
    const int64_t j1 = std::min(S, j0 + BK);
    return causal ? std::min(j1, query_start + i1) : j1;
  }

  // The table rows [lo, hi] that the row at position p can read (its keys' clipped offsets,
  // hidden keys included); lo > hi when it has no key.
  inline void table_rows(int64_t p, int64_t& lo, int64_t& hi) const {
    const int64_t end = causal ? std::min(S, p + 1) : S;
    lo = std::min(std::max(-p, -left), right) + left;
    hi = end <= 0 ? lo - 1 : std::min(std::max(end - 1 - p, -left), right) + left;
  }
};

// The call's tensors as contiguous raw pointers (nullptr for an absent optional one). Varlen
// calls have no masks, and q, k, v as (H, Tq, D), (H, Tk, D), (H, Tk, Dv).
template <typename T, typename I = T>  // I: the type q, k and v are stored in (T otherwise)
struct Inputs {
  const I* q;          // (B, H, L, D)
  const I* k;          // (B, H, S, D)
  const I* v;          // (B, H, S, Dv)
  const T* ak;         // (Hr_k, R, D) or nullptr
  const T* av;         // (Hr_v, R, Dv) or nullptr
  const T* key_bias;   // (B, S) or nullptr
  const T* attn_bias;  // (B, H, L, S) in the strides of Geometry::mB.. or nullptr
  bool ak_finite = true;  // (backward) every entry of ak is finite
  const I* ak_low = nullptr;  // 16-bit inputs with 16-bit GEMMs: the tables in I too
  const I* av_low = nullptr;
};

// What one task's head reads: the queries, keys, values, tables (shared or its own) and key
// bias of one (batch, head) or (sequence, head), and the dropout row of its query 0.
template <typename T, typename I = T>
struct Head {
  int64_t b, h;       // batch row (0 for a varlen sequence) and head: where its mask rows are
  int64_t dropout_row;  // query i's dropout row is dropout_row + i
  const I* q;         // (L, D)
  const I* k;         // (S, D)
  const I* v;         // (S, Dv)
  const T* ak;        // (R, D) or nullptr
  const T* av;        // (R, Dv) or nullptr
  const T* key_bias;  // (S) or nullptr
  const I* ak_low = nullptr;  // the tables in I (16-bit GEMMs), or nullptr
  const I* av_low = nullptr;
};

// The tables of head h: its own rows of per-head tables, the shared ones otherwise.
template <typename T, typename I>
static inline void set_head_tables(const Geometry& g, const Inputs<T, I>& in, Head<T, I>& hd) {
  const int64_t k_off = (g.Hr_k == 1 ? 0 : hd.h) * g.R * g.D;
  const int64_t v_off = (g.Hr_v == 1 ? 0 : hd.h) * g.R * g.Dv;
  hd.ak = in.ak ? in.ak + k_off : nullptr;
  hd.av = in.av ? in.av + v_off : nullptr;
  hd.ak_low = in.ak_low ? in.ak_low + k_off : nullptr;
  hd.av_low = in.av_low ? in.av_low + v_off : nullptr;
}

// Head bh = b * H + h of a padded call.
template <typename T, typename I>
static inline Head<T, I> head_of(const Geometry& g, const Inputs<T, I>& in, const Dropout& drop,
                                 int64_t bh) {
  Head<T, I> hd;
  hd.b = bh / g.H;
  hd.h = bh % g.H;
  hd.dropout_row = drop.first_row(bh, g.L);
  hd.q = in.q + bh * g.L * g.D;
  hd.k = in.k + bh * g.S * g.D;
  hd.v = in.v + bh * g.S * g.Dv;
  set_head_tables(g, in, hd);
  hd.key_bias = in.key_bias ? in.key_bias + hd.b * g.S : nullptr;
  return hd;
}

// A varlen call's packing. Sequence s holds the query rows [cu_q[s], cu_q[s+1]) and the key
// region [cu_k[s], cu_k[s+1]), of which it uses the first keys(s) rows (all of them without
// seqused_k); the kernels hold q, k, v (and out, dq, dk, dv) as (H, T, width) contiguous, so
// the rows of (sequence s, head h) are one contiguous block from row h * T + cu[s] (which is
// also the dropout row of its query 0).
struct Packing {
  int64_t N, H, Tq, Tk;             // sequences, heads, queries and keys (regions) in all
  const int64_t* cu_q;              // (N + 1)
  const int64_t* cu_k;              // (N + 1)
  const int64_t* used_k = nullptr;  // (N): the keys each sequence uses (seqused_k); null: all

  inline int64_t q_row(int64_t s, int64_t h) const { return h * Tq + cu_q[s]; }
  inline int64_t k_row(int64_t s, int64_t h) const { return h * Tk + cu_k[s]; }
  inline int64_t queries(int64_t s) const { return cu_q[s + 1] - cu_q[s]; }
  inline int64_t region(int64_t s) const { return cu_k[s + 1] - cu_k[s]; }
  inline int64_t keys(int64_t s) const { return used_k ? used_k[s] : region(s); }
};

// Head h of sequence s of a varlen call (g: the sequence's geometry).
template <typename T, typename I>
static inline Head<T, I> varlen_head(const Geometry& g, const Packing& pk,
                                     const Inputs<T, I>& in, int64_t s, int64_t h) {
  Head<T, I> hd;
  hd.b = 0;
  hd.h = h;
  hd.dropout_row = pk.q_row(s, h);
  hd.q = in.q + pk.q_row(s, h) * g.D;
  hd.k = in.k + pk.k_row(s, h) * g.D;
  hd.v = in.v + pk.k_row(s, h) * g.Dv;
  set_head_tables(g, in, hd);
  hd.key_bias = nullptr;
  return hd;
}

// Row i of the dense mask of head (b, h) (read as mrow[j * mS]), or nullptr.
template <typename T>
static inline const T* mask_row(const Geometry& g, const T* attn_bias, int64_t b, int64_t h,
                                int64_t i) {
  return attn_bias ? attn_bias + b * g.mB + h * g.mH + i * g.mL : nullptr;
}

// ------------------------------------------------------------------------------------------
// Explicit vectors for float's row passes (max, exp and sum, dS of far segments): AVX-512 where
// the build's ISA has it (16 lanes, masked tails), AVX2 + FMA otherwise (8 lanes, tails through
// maskload / maskstore), the scalar loops below on any other ISA and for double. A segment's
// tail is one masked vector operation, not a scalar loop. The arithmetic is exp_float's, lane
// by lane (the same reduction and polynomial), so vector and scalar rows agree to rounding.

#if defined(__AVX512F__)
#define RELPOS_VEC_FLOAT 1
struct VecF {
  static constexpr int64_t W = 16;
  using V = __m512;
  using M = __mmask16;
  static RELPOS_INLINE M tail(int64_t n) { return static_cast<M>((1u << n) - 1u); }
  static RELPOS_INLINE V set1(float x) { return _mm512_set1_ps(x); }
  static RELPOS_INLINE V load(const float* p) { return _mm512_loadu_ps(p); }
  // the first n lanes of p, `fill` in the others
  static RELPOS_INLINE V load_tail(const float* p, M m, V fill) {
    return _mm512_mask_loadu_ps(fill, m, p);
  }
  static RELPOS_INLINE void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static RELPOS_INLINE void store_tail(float* p, M m, V v) { _mm512_mask_storeu_ps(p, m, v); }
  static RELPOS_INLINE V zero_off_tail(M m, V v) { return _mm512_maskz_mov_ps(m, v); }
  static RELPOS_INLINE V add(V a, V b) { return _mm512_add_ps(a, b); }
  static RELPOS_INLINE V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static RELPOS_INLINE V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static RELPOS_INLINE V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // max(a, b) that returns b where a is NaN (vmaxps returns its second operand on NaN)
  static RELPOS_INLINE V max_skip_nan(V a, V b) { return _mm512_max_ps(a, b); }
  static RELPOS_INLINE float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static RELPOS_INLINE float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static RELPOS_INLINE V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  // min(hi, max(lo, x)), NaN passing through (vmaxps / vminps return their second operand)
  static RELPOS_INLINE V clamp(V x, V lo, V hi) {
    return _mm512_min_ps(hi, _mm512_max_ps(lo, x));
  }
  // exp's upper clamp: vscalefps overflows to +inf by itself, so exp_float's range fix for
  // +inf is not needed and x up to the float range is exact (89: 2^128 y, +inf)
  static constexpr float kExpHigh = 89.0f;
  // y · 2^n (one rounding, as y times the power of two), 0 where x < lo (-inf included, NaN
  // not); overflow to +inf
  static RELPOS_INLINE V exp_scale(V y, V n, V, V x, V lo) {
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), y, n);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define RELPOS_VEC_FLOAT 1
struct VecF {
  static constexpr int64_t W = 8;
  using V = __m256;
  using M = __m256i;
  static RELPOS_INLINE M tail(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static RELPOS_INLINE V set1(float x) { return _mm256_set1_ps(x); }
  static RELPOS_INLINE V load(const float* p) { return _mm256_loadu_ps(p); }
  static RELPOS_INLINE V load_tail(const float* p, M m, V fill) {
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
  }
  static RELPOS_INLINE void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static RELPOS_INLINE void store_tail(float* p, M m, V v) { _mm256_maskstore_ps(p, m, v); }
  static RELPOS_INLINE V zero_off_tail(M m, V v) {
    return _mm256_and_ps(_mm256_castsi256_ps(m), v);
  }
  static RELPOS_INLINE V add(V a, V b) { return _mm256_add_ps(a, b); }
  static RELPOS_INLINE V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static RELPOS_INLINE V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static RELPOS_INLINE V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static RELPOS_INLINE V max_skip_nan(V a, V b) { return _mm256_max_ps(a, b); }
  static RELPOS_INLINE float reduce_max(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static RELPOS_INLINE float reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static RELPOS_INLINE V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static RELPOS_INLINE V clamp(V x, V lo, V hi) {
    return _mm256_min_ps(hi, _mm256_max_ps(lo, x));
  }
  static constexpr float kExpHigh = 88.3762626647949f;  // exp_float's: 2^n stays a float
  // y · 2^n, 2^n from t = x · log2(e) + 1.5 · 2^23 (n in its low bits: the biased exponent
  // n + 127); 0 where x < lo (-inf included, NaN not) and +inf where x is +inf
  static RELPOS_INLINE V exp_scale(V y, V, V t, V x, V lo) {
    const __m256i bias = _mm256_set1_epi32(127 - 0x4B400000);
    const __m256i e = _mm256_add_epi32(_mm256_castps_si256(t), bias);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
    const V inf = set1(std::numeric_limits<float>::infinity());
    y = _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y);
    return _mm256_blendv_ps(y, inf, _mm256_cmp_ps(x, inf, _CMP_EQ_OQ));
  }
};
#endif

#if defined(RELPOS_VEC_FLOAT)
// exp_float lane by lane: the same clamps, rounding, reduction and polynomial, so the same
// bits for every x <= 88.37 (the kernels take x <= 0). AVX-512 scales by 2^n with vscalefps
// (one instruction for exp_float's shift, multiply and two range fixes: the exp 17% faster),
// which is exact up to the float range where exp_float clamps at 88.37.
//
// Low: for calls with 16-bit inputs, whose P is rounded to bfloat16 or float16 (or their
// output is): the same reduction, a degree-4 polynomial for e^r on [-ln2/2, ln2/2] (near
// minimax, relative error 2.8e-6 against the degree-7's 1e-7; bfloat16's rounding is 3.9e-3,
// float16's 4.9e-4), three fewer multiply-adds.
template <bool Low = false>
static RELPOS_INLINE VecF::V vec_exp(VecF::V x) {
  using V = VecF::V;
  const V lo = VecF::set1(-87.3365447504019f);
  const V xc = VecF::clamp(x, lo, VecF::set1(VecF::kExpHigh));
  const V magic = VecF::set1(12582912.0f);
  const V t = VecF::fmadd(xc, VecF::set1(1.44269504088896341f), magic);
  const V n = VecF::sub(t, magic);
  V r = VecF::fnmadd(n, VecF::set1(0.693359375f), xc);
  r = VecF::fnmadd(n, VecF::set1(-2.12194440e-4f), r);
  V y;
  if constexpr (Low) {
    y = VecF::set1(4.1513847776e-2f);
    for (const float c : {1.6787473959e-1f, 5.0003013670e-1f, 9.9996683618e-1f, 1.0f})
      y = VecF::fmadd(y, r, VecF::set1(c));
  } else {
    y = VecF::set1(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                          1.6666665459e-1f, 5.0000001201e-1f})
      y = VecF::fmadd(y, r, VecF::set1(c));
    y = VecF::add(VecF::fmadd(VecF::mul(y, r), r, r), VecF::set1(1.0f));
  }
  return VecF::exp_scale(y, n, t, x, lo);
}

// The largest of x[0..n), NaN entries skipped (-inf for n = 0); four accumulators.
static inline float row_max_vec(const float* x, int64_t n) {
  constexpr int64_t W = VecF::W;
  const VecF::V ninf = VecF::set1(-std::numeric_limits<float>::infinity());
  VecF::V m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    m0 = VecF::max_skip_nan(VecF::load(x + j), m0);
    m1 = VecF::max_skip_nan(VecF::load(x + j + W), m1);
    m2 = VecF::max_skip_nan(VecF::load(x + j + 2 * W), m2);
    m3 = VecF::max_skip_nan(VecF::load(x + j + 3 * W), m3);
  }
  for (; j + W <= n; j += W) m0 = VecF::max_skip_nan(VecF::load(x + j), m0);
  if (j < n) m1 = VecF::max_skip_nan(VecF::load_tail(x + j, VecF::tail(n - j), ninf), m1);
  m0 = VecF::max_skip_nan(m0, m1);
  m2 = VecF::max_skip_nan(m2, m3);
  return VecF::reduce_max(VecF::max_skip_nan(m0, m2));
}

// x[j] = exp(x[j] - offset) over n entries; returns their sum. (Low: vec_exp's.) With Acc,
// also acc[j] += x[j] (the band's bucket masses, in the same pass).
template <bool Low = false, bool Acc = false>
static inline float exp_sum_vec(float* x, int64_t n, float offset, float* acc = nullptr) {
  constexpr int64_t W = VecF::W;
  const VecF::V off = VecF::set1(offset);
  VecF::V s0 = VecF::set1(0.0f), s1 = s0;
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const VecF::V e0 = vec_exp<Low>(VecF::sub(VecF::load(x + j), off));
    const VecF::V e1 = vec_exp<Low>(VecF::sub(VecF::load(x + j + W), off));
    VecF::store(x + j, e0);
    VecF::store(x + j + W, e1);
    if constexpr (Acc) {
      VecF::store(acc + j, VecF::add(VecF::load(acc + j), e0));
      VecF::store(acc + j + W, VecF::add(VecF::load(acc + j + W), e1));
    }
    s0 = VecF::add(s0, e0);
    s1 = VecF::add(s1, e1);
  }
  for (; j + W <= n; j += W) {
    const VecF::V e = vec_exp<Low>(VecF::sub(VecF::load(x + j), off));
    VecF::store(x + j, e);
    if constexpr (Acc) VecF::store(acc + j, VecF::add(VecF::load(acc + j), e));
    s0 = VecF::add(s0, e);
  }
  if (j < n) {
    const VecF::M m = VecF::tail(n - j);
    const VecF::V e = vec_exp<Low>(VecF::sub(VecF::load_tail(x + j, m, off), off));
    VecF::store_tail(x + j, m, e);
    if constexpr (Acc) {
      const VecF::V zero = VecF::set1(0.0f);
      VecF::store_tail(acc + j, m, VecF::add(VecF::load_tail(acc + j, m, zero), e));
    }
    s1 = VecF::add(s1, VecF::zero_off_tail(m, e));
  }
  return VecF::reduce_add(VecF::add(s0, s1));
}

// dS = p (dp - c) over n entries, in place of dp; returns its sum.
static inline float far_segment_ds_vec(const float* p, float* dp, int64_t n, float c) {
  constexpr int64_t W = VecF::W;
  const VecF::V cv = VecF::set1(c);
  VecF::V s0 = VecF::set1(0.0f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const VecF::V x = VecF::mul(VecF::load(p + j), VecF::sub(VecF::load(dp + j), cv));
    VecF::store(dp + j, x);
    s0 = VecF::add(s0, x);
  }
  if (j < n) {
    const VecF::M m = VecF::tail(n - j);
    const VecF::V zero = VecF::set1(0.0f);
    const VecF::V x = VecF::mul(VecF::load_tail(p + j, m, zero),
                                VecF::sub(VecF::load_tail(dp + j, m, zero), cv));
    VecF::store_tail(dp + j, m, x);
    s0 = VecF::add(s0, VecF::zero_off_tail(m, x));
  }
  return VecF::reduce_add(s0);
}

// dst[j] += src[j] over n entries (the band's key term, a row's band bucket masses).
static inline void add_to_vec(float* dst, const float* src, int64_t n) {
  constexpr int64_t W = VecF::W;
  int64_t j = 0;
  for (; j + W <= n; j += W)
    VecF::store(dst + j, VecF::add(VecF::load(dst + j), VecF::load(src + j)));
  if (j < n) {
    const VecF::M m = VecF::tail(n - j);
    const VecF::V zero = VecF::set1(0.0f);
    VecF::store_tail(dst + j, m, VecF::add(VecF::load_tail(dst + j, m, zero),
                                           VecF::load_tail(src + j, m, zero)));
  }
}

// ------------------------------------------------------------------------------------------
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
        const V x = add ? VecF::fmadd(acc[r][v], al, VecF::load(c + v * W))
                        : VecF::mul(acc[r][v], al);
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
    vec_gemm_block<MR, NV, Tail>(K, A + i * a_rs, a_rs, a_ks, B, ldb, C + i * ldc, ldc, alpha,
                                 add, last);
  vec_gemm_rest<MR, NV, Tail>(M - i, K, A + i * a_rs, a_rs, a_ks, B, ldb, C + i * ldc, ldc,
                              alpha, add, last);
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

#ifdef RELPOS_HAVE_BF16_TILES
// The bfloat16 P of a call on packed tiles, written by the softmax itself (no float32 P to store
// and read back): out[j] = x[j] rounded to bfloat16 (nearest even) over n entries.
static inline void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + j)));
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + j));
    _mm256_mask_storeu_epi16(out + j, m, y);
  }
}

// out[j] = exp(x[j] - offset) rounded to bfloat16 over n entries (x left as it is); returns the
// sum of the unrounded values (vec_exp<true>: 16-bit calls only). With Acc, also acc[j] += the
// unrounded value (the band's bucket masses, in the same pass).
template <bool Acc = false>
static inline float exp_sum_to_bf16(const float* x, int64_t n, float offset, uint16_t* out,
                                    float* acc = nullptr) {
  const __m512 off = _mm512_set1_ps(offset);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 = vec_exp<true>(_mm512_sub_ps(_mm512_loadu_ps(x + j), off));
    const __m512 e1 = vec_exp<true>(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16), off));
    _mm512_storeu_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    if constexpr (Acc) {
      _mm512_storeu_ps(acc + j, _mm512_add_ps(_mm512_loadu_ps(acc + j), e0));
      _mm512_storeu_ps(acc + j + 16, _mm512_add_ps(_mm512_loadu_ps(acc + j + 16), e1));
    }
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __m512 e = vec_exp<true>(_mm512_sub_ps(_mm512_mask_loadu_ps(off, m, x + j), off));
    _mm256_mask_storeu_epi16(out + j, m, (__m256i)_mm512_cvtneps_pbh(e));
    if constexpr (Acc)
      _mm512_mask_storeu_ps(acc + j, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + j), e));
    s1 = _mm512_add_ps(s1, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}
#endif

// float16 <-> float by the CPU's conversion instructions (vcvtph2ps / vcvtps2ph: 16 lanes with
// AVX-512, 8 with F16C), rounding to nearest even as c10::Half does; the overloads win over
// convert<From, To> for these types. (bfloat16's conversions are shifts the compiler
// vectorizes.)
#if defined(__AVX512F__) || defined(__F16C__)
static inline void convert(const c10::Half* src, float* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + j))));
#else
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(dst + j,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
#endif
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

static inline void convert(const float* src, c10::Half* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + j),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; j < n; ++j) dst[j] = static_cast<c10::Half>(src[j]);
}
#endif

// ------------------------------------------------------------------------------------------
// Row primitives

// max(a, b), NaN if either is.
template <typename T>
static inline T nan_max(T a, T b) {
  return (std::isnan(a) || a > b) ? a : b;
}

// The largest of x[0..n) (-inf for n = 0; NaN entries are skipped), in 16 independent lanes so
// that the compiler vectorizes it (a plain running max is one long dependency chain).
template <typename T>
static inline T row_max(const T* x, int64_t n) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<T, float>) return row_max_vec(x, n);
#endif
  constexpr int W = 16;
  T lane[W];
  for (int u = 0; u < W; ++u) lane[u] = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  for (; j + W <= n; j += W)
    for (int u = 0; u < W; ++u) lane[u] = x[j + u] > lane[u] ? x[j + u] : lane[u];
  T mx = -std::numeric_limits<T>::infinity();
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  for (int u = 0; u < W; ++u) mx = lane[u] > mx ? lane[u] : mx;
  return mx;
}

// x[j] = exp(x[j] - offset) over n entries; returns their sum.
// dst[j] += src[j] over n entries.
template <typename T>
static inline void add_to(T* dst, const T* src, int64_t n) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<T, float>) return add_to_vec(dst, src, n);
#endif
  for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
}

// Low: the vector path may take the cheaper polynomial (vec_exp; 16-bit calls only). Acc:
// acc[j] += x[j] too.
template <typename T, bool Low = false, bool Acc = false>
static inline T exp_sum(T* x, int64_t n, T offset, T* acc = nullptr) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<T, float>) return exp_sum_vec<Low, Acc>(x, n, offset, acc);
#endif
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const T e = exp_<T>(x[j] - offset);
    x[j] = e;
    if constexpr (Acc) acc[j] += e;
    sum += e;
  }
  return sum;
}

// x[j] = exp(x[j] + far - offset) over a far segment, whose relative term is the one constant
// `far`; returns their sum. A hidden key (-inf) gives 0 even where the constant is not finite
// (-inf + inf, -inf + NaN): a non-finite table row reaches no row through keys it does not see.
template <typename T, bool Low = false>
static inline T far_exp_sum(T* x, int64_t n, T offset, T far) {
  if (std::isfinite(far)) return exp_sum<T, Low>(x, n, offset - far);
  const T ninf = -std::numeric_limits<T>::infinity();
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const T e = x[j] == ninf ? T(0) : exp_<T>(x[j] - (offset - far));
    x[j] = e;
    sum += e;
  }
  return sum;
}

// ------------------------------------------------------------------------------------------
// Phases of a row that both directions share. `s` is the row's tile of scores, entry x for key
// j0 + x, holding scale * q_i . k_j from the tile's GEMM.

// The relative term of a row's far segments: one constant per segment, the first and last entry
// of its (R) row of QA (key term) or dOA (value term); 0 without the table.
template <typename T>
struct FarConstants {
  T left, right;
};

template <typename T>
static inline FarConstants<T> far_constants(const T* table_row, int64_t R) {
  return {table_row ? table_row[0] : T(0), table_row ? table_row[R - 1] : T(0)};
}

// Tile masks: the key bias and the row of a dense mask, added to the visible keys [j0, end)
// (-inf hides a key whatever its score, band key term included: added after it).
template <typename T>
static inline void add_masks(T* s, const Geometry& g, int64_t j0, int64_t end, const T* kb,
                             const T* mrow) {
  const T ninf = -std::numeric_limits<T>::infinity();
  if (kb != nullptr) {
#pragma omp simd
    for (int64_t j = j0; j < end; ++j) {
      const T b = kb[j];
      s[j - j0] = b == ninf ? ninf : s[j - j0] + b;
    }
  }
  if (mrow != nullptr) {  // row of a dense mask: mrow[j * mS]
    const int64_t st = g.mS;
    for (int64_t j = j0; j < end; ++j) {
      const T b = mrow[j * st];
      s[j - j0] = b == ninf ? ninf : s[j - j0] + b;
    }
  }
}

// Band key term: s_ij += QA[i, j - p + left] for the band's keys, before the masks (so that a
// hidden key is -inf even where its table row is not finite). The far segments' constants
// QA[i, 0] and QA[i, R-1] are not added here: they are folded into the max and the exp offset,
// so far keys cost no extra pass (hidden far keys then stay out: far_segment_max, far_exp_sum).
template <typename T>
static RELPOS_INLINE void add_band_key_term(T* s, const RowSegments& seg, const T* qa_row) {
  if (qa_row == nullptr) return;
  T* band_scores = s + seg.n_left;
  const T* band = qa_row + seg.band_row;  // band[x] = QA[i, (fl + x) - p + left]
  add_to<T>(band_scores, band, seg.n_band);
}

template <typename T>
struct SegmentSums {
  T left, band, right;
};

// s = exp(s + far constant - offset), segment by segment; returns each segment's sum. Low:
// a call with 16-bit inputs (exp_sum). With buckets (R entries), the row's bucket masses are
// added in the same pass (add_to_buckets's; the band's table rows are 1 .. R-2).
template <typename T, bool Low = false>
static RELPOS_INLINE SegmentSums<T> exp_segments(T* s, const RowSegments& seg,
                                                 FarConstants<T> qa_far, T offset,
                                                 T* buckets = nullptr, int64_t R = 0) {
  T* band_scores = s + seg.n_left;
  SegmentSums<T> sum;
  sum.left = far_exp_sum<T, Low>(s, seg.n_left, offset, qa_far.left);
  if (buckets != nullptr)
    sum.band = exp_sum<T, Low, true>(band_scores, seg.n_band, offset, buckets + seg.band_row);
  else
    sum.band = exp_sum<T, Low>(band_scores, seg.n_band, offset);
  sum.right = far_exp_sum<T, Low>(band_scores + seg.n_band, seg.n_right, offset, qa_far.right);
  if (buckets != nullptr) {
    buckets[0] += sum.left;
    buckets[R - 1] += sum.right;
  }
  return sum;
}

// Bucket update: adds a row's bucket sums to its R table rows, the far segments' (known) sums to
// rows 0 and R-1, the band entry by entry.
template <typename T>
static RELPOS_INLINE void add_to_buckets(T* buckets, int64_t R, const RowSegments& seg,
                                         T far_left_sum, const T* band, T far_right_sum) {
  buckets[0] += far_left_sum;
  buckets[R - 1] += far_right_sum;
  add_to<T>(buckets + seg.band_row, band, seg.n_band);
}

// Bucket update of a row whose far sums are not known (after dropout): sums them first.
template <typename T>
static RELPOS_INLINE void bucket_row(const T* x, int64_t R, const RowSegments& seg,
                                     T* buckets) {
  T sum_l = 0, sum_r = 0;
#pragma omp simd reduction(+ : sum_l)
  for (int64_t j = 0; j < seg.n_left; ++j) sum_l += x[j];
  const T* right = x + seg.n_left + seg.n_band;
#pragma omp simd reduction(+ : sum_r)
  for (int64_t j = 0; j < seg.n_right; ++j) sum_r += right[j];
  add_to_buckets(buckets, R, seg, sum_l, x + seg.n_left, sum_r);
}

// ------------------------------------------------------------------------------------------
// Forward phases

// One thread's state for the query block it works on: blocks of at most BQ rows, tiles of at
// most `tile` scores (BQ · BK for one block size; the largest of a varlen call's sequences).
template <typename T, typename I = T>
struct ForwardBlock {
  std::vector<T> scores;  // (tile): S of the current tile (nq, nk), then P (row stride nk)
  std::vector<T> qa;      // (BQ, R): QA = scale · Q_I @ aK^T
  std::vector<T> pb;      // (BQ, R): Pb, each row's probability mass per table row
  std::vector<T> acc;     // (BQ, Dv): sum_j p_ij v_j
  std::vector<T> m, l;    // (BQ): the online softmax's running max and sum
  // 16-bit inputs only: Q_I widened (BQ, D); P rounded to I (tile) for the 16-bit value GEMM,
  // or, without 16-bit GEMMs, K_J (BK, D) and V_J (BK, Dv) widened
  std::vector<T> q_wide, k_wide, v_wide;
  std::vector<I> p_low, pb_low;  // P and Pb rounded to I for the 16-bit GEMMs
  bool gemms16 = false;          // 16-bit inputs: the tile GEMMs take 16-bit operands
  TileGemm tiles = kNoTiles;     // ... on packed tiles (bfloat16, AMX or VDPBF16PS):
  AmxBuffer q_pack, pb_pack;  // Q_I (rows; times a power-of-two scale: q_scaled), Pb as it is
  bool q_scaled = false;      // rounded
  AmxBuffer p_rows;  // P in bfloat16, row-major (row stride p_ld), the P @ V GEMM's A as it is
  int64_t p_ld = 0;  // (the tile GEMMs read it with that stride): zeros past each row's keys
  AmxOperand v_op, ak_op, av_op;  // V_J cut short and aV (pairs), aK (transposed)
  AmxHeadTiles k_head, v_head;    // a head's K_J (transposed) and V_J (pairs), kept

  ForwardBlock(int64_t BQ, int64_t tile, int64_t R, int64_t Dv, bool keys, bool values,
               int64_t D = 0, int64_t BK = 0, bool low_gemms = false,
               TileGemm tile_gemms = kNoTiles)
      : scores(tile), qa(keys ? BQ * R : 0), pb(values ? BQ * R : 0), acc(BQ * Dv), m(BQ),
        l(BQ) {
    if constexpr (!std::is_same_v<T, I>) {
      q_wide.resize(BQ * D);
      if (low_gemms) {
        gemms16 = true;
        pb_low.resize(values ? BQ * R : 0);
        if (tile_gemms != kNoTiles) {
          tiles = tile_gemms;
          q_pack.resize(amx_tiles_of(BQ) * amx_kblocks(D) * kTileElems);
          p_ld = amx_kblocks(BK) * 32;
          p_rows.resize(amx_tiles_of(BQ) * 16 * p_ld);
          pb_pack.resize(values ? amx_tiles_of(BQ) * amx_kblocks(R) * kTileElems : 0);
          v_op.buf.resize(amx_tiles_of(Dv) * amx_kblocks(BK) * kTileElems);
          ak_op.buf.resize(keys ? amx_tiles_of(R) * amx_kblocks(D) * kTileElems : 0);
          av_op.buf.resize(values ? amx_tiles_of(Dv) * amx_kblocks(R) * kTileElems : 0);
        } else {
          p_low.resize(tile);
        }
      } else {
        k_wide.resize(BK * D);
        v_wide.resize(BK * Dv);
      }
    }
  }
};

// The max of a far segment's scores plus its constant; -inf where the segment has no visible
// score (hidden keys are -inf), whatever the constant (-inf + NaN would make the row NaN).
template <typename T>
static inline T far_segment_max(const T* s, int64_t n, T far) {
  const T mx = row_max<T>(s, n);
  return mx == -std::numeric_limits<T>::infinity() ? mx : mx + far;
}

// The row's max over its visible scores, far constants included. row_max skips NaN; a row whose
// visible scores are all NaN must stay NaN, not look empty (other NaNs reach the row through
// exp and its sum).
template <typename T>
static RELPOS_INLINE T segments_max(const T* s, const RowSegments& seg, FarConstants<T> qa_far) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const T* band_scores = s + seg.n_left;
  T mx = ninf;
  if (seg.n_left > 0) mx = nan_max<T>(mx, far_segment_max<T>(s, seg.n_left, qa_far.left));
  if (seg.n_band > 0) mx = nan_max<T>(mx, row_max<T>(band_scores, seg.n_band));
  if (seg.n_right > 0)
    mx = nan_max<T>(mx, far_segment_max<T>(band_scores + seg.n_band, seg.n_right,
                                           qa_far.right));
  if (mx == ninf) {
    for (int64_t j = 0; j < seg.n_visible; ++j)
      if (std::isnan(s[j])) mx = std::numeric_limits<T>::quiet_NaN();
  }
  return mx;
}

// RESCALE: the row's running sum, output accumulator and bucket masses, all relative to the old
// max, times alpha = exp(m_old - m_new).
template <typename T, typename I>
static RELPOS_INLINE void rescale_row(ForwardBlock<T, I>& w, int64_t r, T alpha, int64_t Dv,
                                      int64_t R, bool values) {
  w.l[r] *= alpha;
  T* a = w.acc.data() + r * Dv;
  for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
  if (values) {
    T* pr = w.pb.data() + r * R;
    for (int64_t x = 0; x < R; ++x) pr[x] *= alpha;
  }
}

// exp_segments for a call on packed tiles without dropout: P rounded to bfloat16 into p_row
// (nk entries: zeros past the visible keys, up to p_ld), s left as it is; with pb_row (R
// entries) the row's bucket masses added in the same pass (add_to_buckets's).
template <typename T>
static RELPOS_INLINE SegmentSums<T> exp_segments_bf16(T* s, const RowSegments& seg,
                                                      FarConstants<T> qa_far, T offset,
                                                      uint16_t* p_row, int64_t p_ld, T* pb_row,
                                                      int64_t R) {
  SegmentSums<T> sum{};
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<T, float>) {
    T* band_scores = s + seg.n_left;
    T* right_scores = band_scores + seg.n_band;
    const int64_t right0 = seg.n_left + seg.n_band;
    if (std::isfinite(qa_far.left)) {
      sum.left = exp_sum_to_bf16(s, seg.n_left, offset - qa_far.left, p_row);
    } else {
      sum.left = far_exp_sum<T, true>(s, seg.n_left, offset, qa_far.left);
      round_to_bf16(s, seg.n_left, p_row);
    }
    if (pb_row != nullptr)
      sum.band = exp_sum_to_bf16<true>(band_scores, seg.n_band, offset, p_row + seg.n_left,
                                       pb_row + seg.band_row);
    else
      sum.band = exp_sum_to_bf16(band_scores, seg.n_band, offset, p_row + seg.n_left);
    if (std::isfinite(qa_far.right)) {
      sum.right = exp_sum_to_bf16(right_scores, seg.n_right, offset - qa_far.right,
                                  p_row + right0);
    } else {
      sum.right = far_exp_sum<T, true>(right_scores, seg.n_right, offset, qa_far.right);
      round_to_bf16(right_scores, seg.n_right, p_row + right0);
    }
    std::fill(p_row + seg.n_visible, p_row + p_ld, uint16_t(0));
    if (pb_row != nullptr) {
      pb_row[0] += sum.left;
      pb_row[R - 1] += sum.right;
    }
  }
#endif
  return sum;
}

// Online-softmax step of row r over one tile: the new max, the rescale of the row's state, then
// s = exp(s - m_new) (far constants folded in; the hidden tail [n_visible, nk) set to 0) and
// l += its sum; with p_row (packed tiles, no dropout), P goes to p_row in bfloat16 instead, s
// left as it is (exp_segments_bf16). With buckets (no dropout), the row's bucket masses (R) are
// added in the same pass. Returns false, with the row's tile (or p_row) zeroed, while the row
// has seen no key.
template <typename T, typename I>
static RELPOS_INLINE bool online_softmax_step(ForwardBlock<T, I>& w, int64_t r, T* s, int64_t nk,
                                              const RowSegments& seg, FarConstants<T> qa_far,
                                              int64_t Dv, int64_t R, bool values,
                                              SegmentSums<T>& p_sums, uint16_t* p_row,
                                              T* buckets) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const T mx = segments_max<T>(s, seg, qa_far);
  const T m_old = w.m[r];
  const T m_new = std::isnan(mx) ? mx : std::max(m_old, mx);
  if (m_new == ninf) {  // nothing visible yet in this row
    if (p_row != nullptr)
      std::fill(p_row, p_row + w.p_ld, uint16_t(0));
    else
      std::fill(s, s + nk, T(0));
    return false;
  }
  // RESCALE to the new max; a row's first visible tile finds its state empty (0) and skips it
  if (m_old != ninf) {
    const T alpha = exp_<T>(m_old - m_new);
    if (alpha != T(1)) rescale_row(w, r, alpha, Dv, R, values);
  }
  w.m[r] = m_new;
  if (p_row != nullptr) {
    // after the rescale above, so the row's masses are relative to m_new
    p_sums = exp_segments_bf16<T>(s, seg, qa_far, m_new, p_row, w.p_ld, buckets, R);
  } else {
    p_sums = exp_segments<T, !std::is_same_v<T, I>>(s, seg, qa_far, m_new, buckets, R);
    for (int64_t j = seg.n_visible; j < nk; ++j) s[j] = T(0);
  }
  w.l[r] += p_sums.left + p_sums.band + p_sums.right;
  return true;
}

// Dropout of one row of P (forward; `row` its dropout row): dropped entries 0, kept ones times
// 1 / (1 - p).
template <typename T>
static RELPOS_INLINE void drop_row(T* s, const RowSegments& seg, const Dropout& drop,
                                   int64_t row, T inv_keep) {
  uint32_t k1, k2;
  drop.row_keys(row, k1, k2);
  const uint32_t th = drop.threshold;
  const int64_t j0 = seg.j0;
#pragma omp simd
  for (int64_t j = 0; j < seg.n_visible; ++j) {
    const bool kept = Dropout::keep(static_cast<uint32_t>(drop.key_offset + j0 + j), k1, k2, th);
    s[j] = kept ? s[j] * inv_keep : T(0);
  }
}

// out (nq, n) = scale · A (nq, K) @ B^T for rows A and B (n, K) in I (Q_I or dO_I against K_J,
// V_J, aK or aV), 16-bit operands: on packed tiles (tiles), A packed as rows in a_rows (the scale
// already in it where a_scaled) and B packed into op unless it holds B already (or b_packed:
// packed already, op null); else MKL's GEMM on a_low and b.
template <typename T, typename I>
static inline void gemm_scores_low(TileGemm tiles, AmxOperand* op, int64_t nq, int64_t n, int64_t K,
                                   T scale, const AmxBuffer& a_rows, bool a_scaled,
                                   const I* a_low, const I* b, T* out,
                                   const uint16_t* b_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    if (tiles) {
      if (b_packed == nullptr) {
        if (!op->holds(b, n)) {
          amx_pack_transposed(bits_of(b), n, K, op->buf.p);
          op->mark(b, n);
        }
        b_packed = op->buf.p;
      }
      tile_gemm_scaled(tiles, nq, n, amx_kblocks(K), a_scaled ? 1.0f : scale, a_rows.p, b_packed,
                       out);
      return;
    }
  }
#endif
  low_gemm<I>(false, true, nq, n, K, scale, a_low, b, T(0), out);
}

// acc_I (nq, Dv) += A (nq, n) @ B (n, Dv), A float (P or Pb, row stride n) rounded to I (into
// a_pack for the packed tiles, a_low for MKL), B in I (V_J or aV; packed into op unless it
// holds B already). Packed tiles with a_rows: A is there already, in bfloat16 rows of stride
// lda (zeros past n; a_pack null); with b_packed, B too (op null).
template <typename T, typename I>
static inline void values_low(ForwardBlock<T, I>& w, AmxOperand* op, int64_t nq, int64_t n,
                              int64_t Dv, const T* a, AmxBuffer* a_pack, I* a_low, const I* b,
                              const uint16_t* a_rows = nullptr, int64_t lda = 0,
                              const uint16_t* b_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    if (w.tiles) {
      if (b_packed == nullptr) {
        if (!op->holds(b, n)) {
          amx_pack_pairs(bits_of(b), n, Dv, op->buf.p);
          op->mark(b, n);
        }
        b_packed = op->buf.p;
      }
      if (a_rows != nullptr) {
        tile_gemm_add(w.tiles, nq, Dv, amx_kblocks(n), a_rows, b_packed, w.acc.data(), 1.0f, lda);
      } else {
        amx_pack_rows(a, nq, n, n, a_pack->p);
        tile_gemm_add(w.tiles, nq, Dv, amx_kblocks(n), a_pack->p, b_packed, w.acc.data());
      }
      return;
    }
  }
#endif
  convert(a, a_low, nq * n);
  low_gemm<I>(false, false, nq, Dv, n, T(1), a_low, b, T(1), w.acc.data());
}

// Prologue of a query block: QA of its rows; the online softmax's state emptied.
template <typename T, typename I>
static RELPOS_INLINE void forward_prologue(const Geometry& g, const Head<T, I>& hd,
                                           ForwardBlock<T, I>& w, int64_t nq, T scale,
                                           const T* q_block, const I* q_low) {
  const int64_t R = g.R;
  const T ninf = -std::numeric_limits<T>::infinity();
  // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T (16-bit operands where the tables come in I)
  if constexpr (!std::is_same_v<T, I>) {
    if (hd.ak_low)
      gemm_scores_low(w.tiles, &w.ak_op, nq, R, g.D, scale, w.q_pack, w.q_scaled, q_low, hd.ak_low,
                      w.qa.data());
  }
  if (hd.ak && !hd.ak_low) gemm_nt<T>(nq, R, g.D, scale, q_block, hd.ak, T(0), w.qa.data());
  if (hd.av) std::fill(w.pb.begin(), w.pb.begin() + nq * R, T(0));
  std::fill(w.acc.begin(), w.acc.begin() + nq * g.Dv, T(0));
  std::fill(w.m.begin(), w.m.end(), ninf);
  std::fill(w.l.begin(), w.l.end(), T(0));
}

// Row r of one tile: band key term, masks, online-softmax step, then dropout and the bucket
// update Pb[i, r_ij] += p_ij. Leaves P (0 where hidden) for the P @ V GEMM in the row's tile
// or, on packed tiles, in bfloat16 in row r of w.p_rows (row stride w.p_ld).
template <typename T, typename I>
static RELPOS_INLINE void forward_row(const Geometry& g, const Head<T, I>& hd,
                                      const T* attn_bias, const Dropout& drop, T inv_keep,
                                      ForwardBlock<T, I>& w, int64_t r, int64_t i, int64_t j0,
                                      int64_t j1) {
  const int64_t nk = j1 - j0, R = g.R;
  T* s = w.scores.data() + r * nk;
  const RowSegments seg = g.segments(g.query_start + i, j0, j1);
  const T* qa_row = hd.ak ? w.qa.data() + r * R : nullptr;
  const FarConstants<T> qa_far = far_constants(qa_row, R);
  add_band_key_term<T>(s, seg, qa_row);
  add_masks<T>(s, g, j0, seg.end, hd.key_bias, mask_row(g, attn_bias, hd.b, hd.h, i));
  // the bfloat16 row the tile GEMMs read (written by the softmax where there is no dropout)
  uint16_t* p_row = w.tiles ? w.p_rows.p + r * w.p_ld : nullptr;
  T* pb_row = hd.av ? w.pb.data() + r * R : nullptr;
  SegmentSums<T> p_sums;
  if (!online_softmax_step(w, r, s, nk, seg, qa_far, g.Dv, R, hd.av != nullptr, p_sums,
                           drop.on ? nullptr : p_row, drop.on ? nullptr : pb_row)) {
    if (p_row != nullptr && drop.on) std::fill(p_row, p_row + w.p_ld, uint16_t(0));
    return;
  }
  if (drop.on) {
    drop_row<T>(s, seg, drop, hd.dropout_row + i, inv_keep);
    if (pb_row) bucket_row<T>(s, R, seg, pb_row);
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<T, float>) {
      if (p_row != nullptr) {
        round_to_bf16(s, nk, p_row);
        std::fill(p_row + nk, p_row + w.p_ld, uint16_t(0));
      }
    }
#endif
  }  // (without dropout the softmax added the bucket masses)
}

// Epilogue of a query block: acc += Pb @ aV, out = acc / l, lse = m + log l. A row that sees no
// key gets zeros and lse = +inf, so the backward's P is 0.
template <typename T, typename I>
static RELPOS_INLINE void forward_epilogue(const Geometry& g, const Head<T, I>& hd,
                                           ForwardBlock<T, I>& w, int64_t nq, I* out_block,
                                           T* lse_block) {
  const int64_t Dv = g.Dv;
  // acc_I (nq, Dv) += Pb_I (nq, R) @ aV (R, Dv) (Pb rounded to I where aV comes in I)
  if constexpr (!std::is_same_v<T, I>) {
    if (hd.av_low)
      values_low(w, &w.av_op, nq, g.R, Dv, w.pb.data(), &w.pb_pack, w.pb_low.data(), hd.av_low);
  }
  if (hd.av && !hd.av_low) gemm_nn<T>(nq, Dv, g.R, T(1), w.pb.data(), hd.av, T(1), w.acc.data());
  for (int64_t r = 0; r < nq; ++r) {
    const T row_sum = w.l[r];
    I* o = out_block + r * Dv;
    const T* a = w.acc.data() + r * Dv;
    if (row_sum > T(0) || std::isnan(row_sum) || std::isnan(w.m[r])) {
      const T inv = T(1) / row_sum;
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<I>(a[d] * inv);
      lse_block[r] = w.m[r] + std::log(row_sum);
    } else {
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<I>(T(0));
      lse_block[r] = std::numeric_limits<T>::infinity();
    }
  }
}

// With 16-bit GEMMs, Q_I's operand for the block: packed in tiles (else read in place),
// times the scale where it is a power of two (1/8 for D = 64: exact, and the score tiles are
// then stored straight from the tile registers, with no pass to scale them).
template <typename T, typename I>
static inline void pack_query_low(ForwardBlock<T, I>& w, const I* q_block, int64_t nq, int64_t D,
                                  T scale) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    if (!w.tiles) return;
    w.q_scaled = power_of_two(scale);
    amx_pack_rows(bits_of(q_block), nq, D, D, w.q_pack.p, w.q_scaled ? scale : 1.0f);
  }
#endif
}

// One forward task: the query block [i0, min(L, i0 + BQ)) of one head, streamed through its key
// blocks of BK keys by the online softmax; writes the block's rows of out_head (L, Dv) and
// lse_head (L).
template <typename T, typename I>
static RELPOS_INLINE void forward_task(const Geometry& g, const Head<T, I>& hd,
                                       const T* attn_bias, T scale, const Dropout& drop,
                                       ForwardBlock<T, I>& w, int64_t i0, int64_t BQ, int64_t BK,
                                       I* out_head, T* lse_head) {
  const int64_t D = g.D, Dv = g.Dv;
  const T inv_keep = static_cast<T>(drop.inv_keep);
  const int64_t i1 = std::min(g.L, i0 + BQ), nq = i1 - i0;
  const I* q_block = hd.q + i0 * D;
  constexpr bool low = !std::is_same_v<T, I>;
  const bool low_gemms = low && w.gemms16;  // else K_J, V_J widened per tile
  const T* q_wide = nullptr;  // Q_I as T: for QA and the score GEMM without 16-bit GEMMs
  if constexpr (low) {
    if (!low_gemms || (hd.ak != nullptr && hd.ak_low == nullptr)) {
      convert(q_block, w.q_wide.data(), nq * D);
      q_wide = w.q_wide.data();
    }
    if (low_gemms) pack_query_low(w, q_block, nq, D, scale);
  } else {
    q_wide = q_block;
  }
  forward_prologue(g, hd, w, nq, scale, q_wide, q_block);
  for (int64_t j0 = 0; j0 < g.S; j0 += BK) {
    if (!g.block_visible(i1, j0)) break;
    const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
    // the head's K_J and V_J as packed operands (V_J cut by the causal mask: nullptr, packed alone)
    const uint16_t* k_packed = nullptr;
    const uint16_t* v_packed = nullptr;
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<I, c10::BFloat16>) {
      if (w.tiles) {
        k_packed = amx_head_tile_transposed(w.k_head, hd.k, g.S, BK, j0, D);
        v_packed = amx_head_tile_pairs(w.v_head, hd.v, g.S, BK, j0, nk, Dv);
      }
    }
#endif
    // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T
    if constexpr (low) {
      if (low_gemms) {
        gemm_scores_low(w.tiles, nullptr, nq, nk, D, scale, w.q_pack, w.q_scaled, q_block,
                        hd.k + j0 * D, w.scores.data(), k_packed);
      } else {
        convert(hd.k + j0 * D, w.k_wide.data(), nk * D);
        gemm_nt<T>(nq, nk, D, scale, q_wide, w.k_wide.data(), T(0), w.scores.data());
      }
    } else {
      gemm_nt<T>(nq, nk, D, scale, q_block, hd.k + j0 * D, T(0), w.scores.data());
    }
    for (int64_t r = 0; r < nq; ++r)
      forward_row(g, hd, attn_bias, drop, inv_keep, w, r, i0 + r, j0, j1);
    // acc_I (nq, Dv) += P_IJ (nq, nk) @ V_J (nk, Dv)
    if constexpr (low) {
      if (low_gemms) {
        values_low(w, &w.v_op, nq, nk, Dv, w.scores.data(), nullptr, w.p_low.data(),
                   hd.v + j0 * Dv, w.p_rows.p, w.p_ld, v_packed);
      } else {
        convert(hd.v + j0 * Dv, w.v_wide.data(), nk * Dv);
        gemm_nn<T>(nq, Dv, nk, T(1), w.scores.data(), w.v_wide.data(), T(1), w.acc.data());
      }
    } else {
      gemm_nn<T>(nq, Dv, nk, T(1), w.scores.data(), hd.v + j0 * Dv, T(1), w.acc.data());
    }
  }
  forward_epilogue(g, hd, w, nq, out_head + i0 * Dv, lse_head + i0);
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

// Padded tasks: (batch, head, query block).
template <typename T, typename I = T>
static void forward_impl(const Geometry& g, const Inputs<T, I>& in, T scale, const Dropout& drop,
                         I* out, T* lse, HalfGemms gemms = {}) {
  const int64_t L = g.L;
  const int64_t BQ = forward_query_block(L, g.B * g.H), BK = key_block_size(L, g.S);
  const int64_t n_query_blocks = (L + BQ - 1) / BQ;
  const TileGemm tiles = tile_gemms_of(gemms, BQ, BK, kAmxForwardRows);

  at::parallel_for(0, g.B * g.H * n_query_blocks, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    ForwardBlock<T, I> w(BQ, BQ * BK, g.R, g.Dv, in.ak != nullptr, in.av != nullptr, g.D, BK,
                         gemms.low, tiles);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t bh = task / n_query_blocks, qb = task % n_query_blocks;
      forward_task(g, head_of(g, in, drop, bh), in.attn_bias, scale, drop, w, qb * BQ, BQ, BK,
                      out + bh * L * g.Dv, lse + bh * L);
    }
  });
}

// A varlen call: its packing, each sequence's geometry, and what one thread's buffers must hold
// for any of them (the largest query block, tile and R).
struct VarlenCall {
  Packing pk;
  std::vector<Geometry> seqs;  // (N)
  int64_t D = 0, Dv = 0, BQ = 1, tile = 0, R = 1;
  int64_t heads = 1;  // N · H: the (sequence, head) pairs, for forward_query_block
  int64_t BK = 1;     // the largest key block
};

// Varlen tasks: (sequence, head, query block), each sequence with its own block sizes. The
// tasks of sequence s are first_task[s] + h · (its query blocks) + qb.
template <typename T, typename I = T>
static void forward_varlen_impl(const VarlenCall& vc, const Inputs<T, I>& in, T scale,
                                const Dropout& drop, I* out, T* lse, HalfGemms gemms = {}) {
  const Packing& pk = vc.pk;
  std::vector<int64_t> first_task(pk.N + 1, 0);
  for (int64_t s = 0; s < pk.N; ++s) {
    const int64_t L = vc.seqs[s].L, BQ = forward_query_block(L, vc.heads);
    first_task[s + 1] = first_task[s] + pk.H * ((L + BQ - 1) / BQ);
  }
  const TileGemm tiles = tile_gemms_of(gemms, vc.BQ, vc.BK, kAmxForwardRows);

  at::parallel_for(0, first_task[pk.N], 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    ForwardBlock<T, I> w(vc.BQ, vc.tile, vc.R, vc.Dv, in.ak != nullptr, in.av != nullptr, vc.D,
                         vc.BK, gemms.low, tiles);
    for (int64_t task = begin; task < stop; ++task) {
      // the last sequence whose tasks start at or before this one (sequences without queries
      // have none)
      const int64_t s =
          std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const Geometry& g = vc.seqs[s];
      const int64_t BQ = forward_query_block(g.L, vc.heads);
      const int64_t n_query_blocks = (g.L + BQ - 1) / BQ;
      const int64_t h = (task - first_task[s]) / n_query_blocks;
      const int64_t qb = (task - first_task[s]) % n_query_blocks;
      const int64_t row = pk.q_row(s, h);
      forward_task(g, varlen_head(g, pk, in, s, h), static_cast<const T*>(nullptr), scale,
                   drop, w, qb * BQ, BQ,
                   key_block_size(g.L, g.S), out + row * g.Dv, lse + row);
    }
  });
}

// ------------------------------------------------------------------------------------------
// Backward phases

// One thread's state for the query block it works on (sizes as for ForwardBlock). With 16-bit
// inputs (I) it also holds the head's dK and dV in float (S_max rows: the largest S of the call)
// until the task rounds them once, Q_I and dO_I widened (for the table gradients), and either
// P (or P dropped) and dS rounded to I for the 16-bit GEMMs or, without them, K_J and V_J
// widened.
template <typename T, typename I = T>
struct BackwardBlock {
  std::vector<T> scores;     // (tile): S of the current tile (nq, nk), then P (row stride nk)
  std::vector<T> dp;         // (tile): dP = dO @ V_J^T (+ dOA), then dS
  std::vector<T> p_dropped;  // (tile), with dropout only: P times the keep mask / (1 - p)
  std::vector<T> qa;         // (BQ, R): QA = scale · Q_I @ aK^T
  std::vector<T> doa;        // (BQ, R): dOA = dO_I @ aV^T
  std::vector<T> pb;         // (BQ, R): Pb, bucket sums of the (dropped) P
  std::vector<T> dsb;        // (BQ, R): dSb, bucket sums of dS
  std::vector<T> dq_acc;     // (BQ, D): dS @ K + dSb @ aK, before the scale
  std::vector<T> delta;      // (BQ): dO_i . out_i
  std::vector<T> q_wide, do_wide, dk_acc, dv_acc, k_wide, v_wide;  // 16-bit inputs only
  std::vector<I> p_low, ds_low;  // 16-bit inputs with 16-bit GEMMs only
  bool gemms16 = false;          // 16-bit inputs: the tile GEMMs take 16-bit operands
  TileGemm tiles = kNoTiles;     // ... on packed tiles (bfloat16, AMX or VDPBF16PS):
  AmxBuffer q_rows, do_rows, q_pairs, do_pairs;  // per query block (Q times a power-of-two
  bool q_scaled = false;                          // scale in q_rows and q_pairs: q_scaled)
  AmxOperand ak_op, av_op;  // aK, aV transposed (kept while the same rows come back)
  AmxOperand k_pairs;       // K_J as pairs where cut short
  AmxHeadTiles k_head_t, v_head_t, k_head_pairs;  // a head's K_J, V_J transposed and K_J as
                                                  // pairs, kept for its query blocks
  AmxBuffer p_t, ds_rows, ds_t;                   // P^T, dS and dS^T of the tile

  BackwardBlock(int64_t BQ, int64_t tile, int64_t R, int64_t D, bool keys, bool values,
                bool dropout, int64_t Dv = 0, int64_t BK = 0, int64_t S_max = 0,
                bool low_gemms = false, TileGemm tile_gemms = kNoTiles)
      : scores(tile), dp(tile), p_dropped(dropout ? tile : 0), qa(keys ? BQ * R : 0),
        doa(values ? BQ * R : 0), pb(values ? BQ * R : 0), dsb(keys ? BQ * R : 0),
        dq_acc(BQ * D), delta(BQ) {
    if constexpr (!std::is_same_v<T, I>) {
      q_wide.resize(BQ * D);
      do_wide.resize(BQ * Dv);
      dk_acc.resize(S_max * D);
      dv_acc.resize(S_max * Dv);
      if (low_gemms) {
        gemms16 = true;
        if (tile_gemms != kNoTiles) {
          tiles = tile_gemms;
          const int64_t kq = amx_kblocks(BQ), kk = amx_kblocks(BK);
          q_rows.resize(amx_tiles_of(BQ) * amx_kblocks(D) * kTileElems);
          do_rows.resize(amx_tiles_of(BQ) * amx_kblocks(Dv) * kTileElems);
          q_pairs.resize(amx_tiles_of(D) * kq * kTileElems);
          do_pairs.resize(amx_tiles_of(Dv) * kq * kTileElems);
          k_pairs.buf.resize(amx_tiles_of(D) * kk * kTileElems);
          ak_op.buf.resize(keys ? amx_tiles_of(R) * amx_kblocks(D) * kTileElems : 0);
          av_op.buf.resize(values ? amx_tiles_of(R) * amx_kblocks(Dv) * kTileElems : 0);
          p_t.resize(amx_tiles_of(BK) * kq * kTileElems);
          ds_rows.resize(amx_tiles_of(BQ) * kk * kTileElems);
          ds_t.resize(amx_tiles_of(BK) * kq * kTileElems);
        }
        if (!tiles) {
          p_low.resize(tile);
          ds_low.resize(tile);
        }
      } else {
        k_wide.resize(BK * D);
        v_wide.resize(BK * Dv);
      }
    }
  }
};

// The packed-tile GEMMs of the bfloat16 backward (see the forward's): Q_I, dO_I as row tiles and as
// pairs, once per query block (Q times the scale where it is a power of two: exact).
template <typename T, typename I>
static inline void backward_pack_block(BackwardBlock<T, I>& w, int64_t nq, int64_t D, int64_t Dv,
                                       T scale, const I* q_block, const I* do_block) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    w.q_scaled = power_of_two(scale);
    const float q_scale = w.q_scaled ? scale : 1.0f;
    amx_pack_rows(bits_of(q_block), nq, D, D, w.q_rows.p, q_scale);
    amx_pack_pairs(bits_of(q_block), nq, D, w.q_pairs.p, q_scale);
    amx_pack_rows(bits_of(do_block), nq, Dv, Dv, w.do_rows.p);
    amx_pack_pairs(bits_of(do_block), nq, Dv, w.do_pairs.p);
    return;
  }
#endif
  TORCH_CHECK(false, "relpos native: no bfloat16 tile GEMMs in this build");
}

// Rows [r0, r1) of P (pd) and dS (w.dp), done, rounded to bfloat16 into their packed operands
// while in cache: dS as rows, and where r1 ends a 32-row k-block (or the block), that k-block
// of P^T and dS^T.
template <typename T, typename I>
static inline void backward_pack_rows(BackwardBlock<T, I>& w, int64_t nq, int64_t nk,
                                      const T* pd, int64_t r0, int64_t r1) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    for (int64_t r = r0; r < r1; ++r) amx_pack_row(w.dp.data() + r * nk, nk, r, w.ds_rows.p);
    if (r1 % 32 == 0 || r1 == nq) {
      amx_pack_rows_t(pd, nq, nk, w.p_t.p, (r1 - 1) / 32);
      amx_pack_rows_t(w.dp.data(), nq, nk, w.ds_t.p, (r1 - 1) / 32);
    }
  }
#endif
}

// dV_J += P_IJ^T @ dO_I, dq_acc_I += dS_IJ @ K_J and dK_J += scale · dS_IJ^T @ Q_I on packed
// tiles, P (pd) and dS (w.dp) packed by backward_pack_rows, K_J as pairs (k_packed: the head's
// cache; else packed unless held).
template <typename T, typename I>
static inline void backward_tile_gradients_packed(BackwardBlock<T, I>& w, int64_t nq, int64_t nk,
                                               int64_t D, int64_t Dv, T scale, const I* k_tile,
                                               T* dv_tile, T* dk_tile,
                                               const uint16_t* k_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    const int64_t kq = amx_kblocks(nq);
    if (k_packed == nullptr) {
      if (!w.k_pairs.holds(k_tile, nk)) {
        amx_pack_pairs(bits_of(k_tile), nk, D, w.k_pairs.buf.p);
        w.k_pairs.mark(k_tile, nk);
      }
      k_packed = w.k_pairs.buf.p;
    }
    amx_pack_row_padding(nq, nk, w.ds_rows.p);
    tile_gemm_add(w.tiles, nk, Dv, kq, w.p_t.p, w.do_pairs.p, dv_tile);
    tile_gemm_add(w.tiles, nq, D, amx_kblocks(nk), w.ds_rows.p, k_packed, w.dq_acc.data());
    tile_gemm_add(w.tiles, nk, D, kq, w.ds_t.p, w.q_pairs.p, dk_tile, w.q_scaled ? 1.0f : scale);
    return;
  }
#endif
  TORCH_CHECK(false, "relpos native: no bfloat16 tile GEMMs in this build");
}

// delta_i = dO_i . out_i for the rows of a query block.
template <typename T, typename I>
static RELPOS_INLINE void row_deltas(T* delta, const I* do_block, const I* out_block, int64_t nq,
                                     int64_t Dv) {
  for (int64_t r = 0; r < nq; ++r) {
    T acc = 0;
    for (int64_t d = 0; d < Dv; ++d)
      acc += static_cast<T>(do_block[r * Dv + d]) * static_cast<T>(out_block[r * Dv + d]);
    delta[r] = acc;
  }
}

// dS = P (dP - delta') over a far segment, where delta' = delta - the segment's dOA constant;
// dS over dp in place. Returns the segment's sum of dS (its dSb bucket).
template <typename T>
static RELPOS_INLINE T far_segment_ds(const T* p, T* dp, int64_t n, T far_delta) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<T, float>) return far_segment_ds_vec(p, dp, n, far_delta);
#endif
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const T x = p[j] * (dp[j] - far_delta);
    dp[j] = x;
    sum += x;
  }
  return sum;
}

// Without dropout: dS = P (dO . (v_j + aV[r]) - delta) over a row, in place of dP. The band
// gathers its dOA term; each far segment's is a constant, folded into its delta. Returns the
// far segments' dS sums (the band's are added entry by entry in the bucket update).
template <typename T>
static RELPOS_INLINE SegmentSums<T> ds_row(const T* s, T* dp, const RowSegments& seg,
                                           const T* doa_row, FarConstants<T> doa_far,
                                           T row_delta) {
  SegmentSums<T> ds;
  ds.left = far_segment_ds<T>(s, dp, seg.n_left, row_delta - doa_far.left);
  const T* band_p = s + seg.n_left;
  T* band_dp = dp + seg.n_left;
  const T* doa_band = doa_row ? doa_row + seg.band_row : nullptr;
  for (int64_t x = 0; x < seg.n_band; ++x)
    band_dp[x] = band_p[x] * (band_dp[x] + (doa_band ? doa_band[x] : T(0)) - row_delta);
  ds.band = T(0);  // not summed
  ds.right = far_segment_ds<T>(band_p + seg.n_band, band_dp + seg.n_band, seg.n_right,
                               row_delta - doa_far.right);
  return ds;
}

// With dropout: dP += dOA (gathered in the band, constants in the far segments), then with the
// row's keep weights w (0 or 1 / (1 - p)): p_dropped = P w, and dS = P (dP w - delta) in place
// of dP (`row`: the row's dropout row). The hidden tail of p_dropped is set to 0.
template <typename T>
static RELPOS_INLINE void ds_row_dropout(const T* s, T* dp, T* p_dropped, int64_t nk,
                                         const RowSegments& seg, const T* doa_row,
                                         FarConstants<T> doa_far, T row_delta,
                                         const Dropout& drop, int64_t row, T inv_keep) {
  const int64_t nl = seg.n_left, nb = seg.n_band, nr = seg.n_right, nv = seg.n_visible;
  if (doa_row != nullptr) {
    T* band_dp = dp + nl;
    for (int64_t j = 0; j < nl; ++j) dp[j] += doa_far.left;
    const T* doa_band = doa_row + seg.band_row;
    for (int64_t x = 0; x < nb; ++x) band_dp[x] += doa_band[x];
    for (int64_t j = 0; j < nr; ++j) band_dp[nb + j] += doa_far.right;
  }
  uint32_t k1, k2;
  drop.row_keys(row, k1, k2);
  const uint32_t th = drop.threshold;
  const int64_t j0 = seg.j0;
#pragma omp simd
  for (int64_t j = 0; j < nv; ++j) {
    const T w = Dropout::keep(static_cast<uint32_t>(drop.key_offset + j0 + j), k1, k2, th) ? inv_keep : T(0);
    p_dropped[j] = s[j] * w;
    dp[j] = s[j] * (dp[j] * w - row_delta);  // dS
  }
  for (int64_t j = nv; j < nk; ++j) p_dropped[j] = T(0);
}

// A row that the forward left NaN (lse NaN; `s` its scores with the masks applied): P and dS
// are NaN at its keys but 0 at the keys its masks hide (-inf), as the reference's masked softmax
// gives, so that the row reaches neither a hidden key's dk nor a table row it reads only
// through hidden keys.
template <typename T>
static RELPOS_INLINE void nan_row(T* s, T* dp, int64_t n_visible) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t j = 0; j < n_visible; ++j) {
    const T x = s[j] == ninf ? T(0) : nan;
    s[j] = x;
    dp[j] = x;
  }
}

// Row r of one tile: recompute P = exp(s - lse) (band key term, masks, far constants in the
// offsets), turn dP into dS, and add the row's bucket sums to Pb (for daV) and dSb (for dq and
// daK). Leaves P (or P dropped) and dS, both 0 where hidden, for the tile's GEMMs. A row that
// sees no key (lse = +inf) leaves zeros and no bucket sums, whatever the tables hold; a NaN
// row (lse NaN) NaN except at hidden keys (nan_row).
template <typename T, typename I>
static RELPOS_INLINE void backward_row(const Geometry& g, const Head<T, I>& hd,
                                       const T* attn_bias, const Dropout& drop, T inv_keep,
                                       BackwardBlock<T, I>& w,
                                       T* pd, T row_lse, int64_t r, int64_t i, int64_t j0,
                                       int64_t j1) {
  const int64_t nk = j1 - j0, R = g.R;
  T* s = w.scores.data() + r * nk;
  T* dp = w.dp.data() + r * nk;
  T* pd_row = pd + r * nk;
  if (row_lse == std::numeric_limits<T>::infinity()) {
    std::fill(s, s + nk, T(0));
    std::fill(dp, dp + nk, T(0));
    if (drop.on) std::fill(pd_row, pd_row + nk, T(0));
    return;
  }
  const RowSegments seg = g.segments(g.query_start + i, j0, j1);
  const T* qa_row = hd.ak ? w.qa.data() + r * R : nullptr;
  const T* doa_row = hd.av ? w.doa.data() + r * R : nullptr;
  const FarConstants<T> qa_far = far_constants(qa_row, R);
  const FarConstants<T> doa_far = far_constants(doa_row, R);
  add_band_key_term<T>(s, seg, qa_row);
  add_masks<T>(s, g, j0, seg.end, hd.key_bias, mask_row(g, attn_bias, hd.b, hd.h, i));
  const T row_delta = w.delta[r];
  T* pb_row = hd.av ? w.pb.data() + r * R : nullptr;
  T* dsb_row = hd.ak ? w.dsb.data() + r * R : nullptr;
  if (std::isnan(row_lse)) {
    nan_row<T>(s, dp, seg.n_visible);
    if (drop.on) {
      std::copy(s, s + seg.n_visible, pd_row);
      std::fill(pd_row + seg.n_visible, pd_row + nk, T(0));
    }
    if (pb_row) bucket_row<T>(s, R, seg, pb_row);
    if (dsb_row) bucket_row<T>(dp, R, seg, dsb_row);
  } else if (!drop.on) {
    // P, segment by segment (the far constants folded into the offsets)
    exp_segments<T, !std::is_same_v<T, I>>(s, seg, qa_far, row_lse, pb_row, R);  // P, Pb
    const SegmentSums<T> ds_sums = ds_row<T>(s, dp, seg, doa_row, doa_far, row_delta);
    if (dsb_row) add_to_buckets<T>(dsb_row, R, seg, ds_sums.left, dp + seg.n_left, ds_sums.right);
  } else {
    exp_segments<T, !std::is_same_v<T, I>>(s, seg, qa_far, row_lse);
    ds_row_dropout<T>(s, dp, pd_row, nk, seg, doa_row, doa_far, row_delta, drop,
                      hd.dropout_row + i, inv_keep);
    if (pb_row) bucket_row<T>(pd_row, R, seg, pb_row);
    if (dsb_row) bucket_row<T>(dp, R, seg, dsb_row);
  }
  // the hidden tail is 0 in both buffers
  for (int64_t j = seg.n_visible; j < nk; ++j) {
    dp[j] = T(0);
    s[j] = T(0);
  }
}

// Prologue of a query block: delta, QA and dOA of its rows; Pb, dSb and dq_acc zeroed. q_wide
// and do_wide: Q_I and dO_I as T; q_block and do_block as given (I).
template <typename T, typename I>
static RELPOS_INLINE void backward_prologue(const Geometry& g, const Head<T, I>& hd,
                                            BackwardBlock<T, I>& w, int64_t nq, T scale,
                                            const I* q_block, const I* do_block,
                                            const I* out_block, const T* q_wide,
                                            const T* do_wide) {
  const int64_t D = g.D, Dv = g.Dv, R = g.R;
  row_deltas<T, I>(w.delta.data(), do_block, out_block, nq, Dv);
  if (hd.ak) {
    // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T (16-bit operands where the tables come in I,
    // as the forward computed it)
    if constexpr (!std::is_same_v<T, I>) {
      if (hd.ak_low)
        gemm_scores_low(w.tiles, &w.ak_op, nq, R, D, scale, w.q_rows, w.q_scaled, q_block,
                        hd.ak_low, w.qa.data());
    }
    if (!hd.ak_low) gemm_nt<T>(nq, R, D, scale, q_wide, hd.ak, T(0), w.qa.data());
    std::fill(w.dsb.begin(), w.dsb.begin() + nq * R, T(0));
  }
  if (hd.av) {
    // dOA_I (nq, R) = dO_I (nq, Dv) @ aV^T
    if constexpr (!std::is_same_v<T, I>) {
      if (hd.av_low)
        gemm_scores_low(w.tiles, &w.av_op, nq, R, Dv, T(1), w.do_rows, false, do_block, hd.av_low,
                        w.doa.data());
    }
    if (!hd.av_low) gemm_nt<T>(nq, R, Dv, T(1), do_wide, hd.av, T(0), w.doa.data());
    std::fill(w.pb.begin(), w.pb.begin() + nq * R, T(0));
  }
  std::fill(w.dq_acc.begin(), w.dq_acc.begin() + nq * D, T(0));
}

// The relative key term of dq: dq_acc_I += dSb_I @ aK. With a non-finite aK, row by row over
// the table rows each query can read (a row's other buckets are 0, but 0 · inf is NaN, and the
// reference never multiplies them), none for a row that sees no key (lse = +inf).
template <typename T, typename I>
static RELPOS_INLINE void dq_table_term(const Geometry& g, const Head<T, I>& hd,
                                        BackwardBlock<T, I>& w, int64_t i0, int64_t nq,
                                        const T* lse_block, bool ak_finite) {
  const int64_t D = g.D, R = g.R;
  if (ak_finite) {
    // dq_acc_I (nq, D) += dSb_I (nq, R) @ aK (R, D)
    gemm_nn<T>(nq, D, R, T(1), w.dsb.data(), hd.ak, T(1), w.dq_acc.data());
    return;
  }
  for (int64_t r = 0; r < nq; ++r) {
    if (lse_block[r] == std::numeric_limits<T>::infinity()) continue;
    int64_t lo, hi;
    g.table_rows(g.query_start + i0 + r, lo, hi);
    // dq_acc_i (1, D) += dSb_i[lo..hi] (1, n) @ aK[lo..hi] (n, D)
    if (lo <= hi)
      gemm_nn<T>(1, D, hi - lo + 1, T(1), w.dsb.data() + r * R + lo, hd.ak + lo * D, T(1),
                 w.dq_acc.data() + r * D);
  }
}

// Epilogue of a query block: its relative terms of dq, its shares of the table gradients
// (into this head's partials), and dq = scale · dq_acc (rounded to I).
template <typename T, typename I>
static RELPOS_INLINE void backward_epilogue(const Geometry& g, const Head<T, I>& hd,
                                            BackwardBlock<T, I>& w, int64_t i0, int64_t nq,
                                            T scale, bool ak_finite, const T* lse_block,
                                            const T* q_wide, const T* do_wide, T* dak_head,
                                            T* dav_head, I* dq_block) {
  const int64_t D = g.D, Dv = g.Dv, R = g.R;
  if (hd.ak) {
    dq_table_term<T, I>(g, hd, w, i0, nq, lse_block, ak_finite);
    // daK (R, D) += scale · dSb_I^T @ Q_I (nq, D)
    gemm_tn<T>(R, D, nq, scale, w.dsb.data(), q_wide, T(1), dak_head);
  }
  // daV (R, Dv) += Pb_I^T @ dO_I (nq, Dv)
  if (hd.av) gemm_tn<T>(R, Dv, nq, T(1), w.pb.data(), do_wide, T(1), dav_head);
  for (int64_t x = 0; x < nq * D; ++x) dq_block[x] = static_cast<I>(scale * w.dq_acc[x]);
}

// Two blocks a (na entries) and b (nb) as T: widened into wa and wb for 16-bit inputs, the
// inputs themselves otherwise.
template <typename T, typename I>
static RELPOS_INLINE std::pair<const T*, const T*> as_wide2(const I* a, int64_t na,
                                                            std::vector<T>& wa, const I* b,
                                                            int64_t nb, std::vector<T>& wb) {
  if constexpr (std::is_same_v<T, I>) {
    return {a, b};
  } else {
    convert(a, wa.data(), na);
    convert(b, wb.data(), nb);
    return {wa.data(), wb.data()};
  }
}

// What one backward task reads and writes besides its Head: its rows of dO, out and lse, its
// gradients (dk and dv rows its own, written whole by the task) and the table-gradient partials
// it adds to (zeroed by its caller).
template <typename T, typename I = T>
struct HeadGradients {
  const I* dout;  // (L, Dv)
  const I* out;   // (L, Dv)
  const T* lse;   // (L)
  I* dq;          // (L, D)
  I* dk;          // (S, D)
  I* dv;          // (S, Dv)
  T* dak;         // (R, D), or nullptr without rel_keys
  T* dav;         // (R, Dv), or nullptr without rel_values
};

// One backward task: one head, its query blocks of BQ rows, and in each the key blocks of BK
// keys, as the forward did. With 16-bit inputs the five tile GEMMs take 16-bit operands (P and
// dS rounded to I, as torch's flash kernel rounds them) with float accumulation, dK and dV are
// accumulated in float and rounded once at the end; without 16-bit GEMMs K_J and V_J are widened
// per tile and the float GEMMs serve.
template <typename T, typename I>
static RELPOS_INLINE void backward_task(const Geometry& g, const Head<T, I>& hd,
                                        const HeadGradients<T, I>& gr, const T* attn_bias,
                                        T scale, bool ak_finite, const Dropout& drop,
                                        BackwardBlock<T, I>& w, int64_t BQ, int64_t BK) {
  const int64_t L = g.L, S = g.S, D = g.D, Dv = g.Dv;
  const T inv_keep = static_cast<T>(drop.inv_keep);
  constexpr bool low = !std::is_same_v<T, I>;
  const bool low_gemms = low && w.gemms16;
  T* dk = nullptr;  // (S, D) and (S, Dv): where dK and dV accumulate
  T* dv = nullptr;
  if constexpr (low) {
    dk = w.dk_acc.data();
    dv = w.dv_acc.data();
  } else {
    dk = gr.dk;
    dv = gr.dv;
  }
  std::fill(dk, dk + S * D, T(0));
  std::fill(dv, dv + S * Dv, T(0));
  for (int64_t i0 = 0; i0 < L; i0 += BQ) {
    const int64_t i1 = std::min(L, i0 + BQ), nq = i1 - i0;
    const I* q_block = hd.q + i0 * D;
    const I* do_block = gr.dout + i0 * Dv;
    const T* lse_block = gr.lse + i0;
    // Q_I and dO_I as T
    const auto [q_wide, do_wide] = as_wide2<T, I>(q_block, nq * D, w.q_wide, do_block, nq * Dv,
                                                  w.do_wide);
    if (w.tiles) backward_pack_block(w, nq, D, Dv, scale, q_block, do_block);
    backward_prologue<T, I>(g, hd, w, nq, scale, q_block, do_block, gr.out + i0 * Dv, q_wide,
                            do_wide);
    for (int64_t j0 = 0; j0 < S; j0 += BK) {
      if (!g.block_visible(i1, j0)) break;
      const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
      const I* k_tile = hd.k + j0 * D;
      const I* v_tile = hd.v + j0 * Dv;
      const T* k_wide = nullptr;  // K_J and V_J as T (float GEMMs)
      // the head's K_J, V_J (transposed) and K_J (pairs; nullptr where the causal mask cuts
      // the tile) as packed operands
      const uint16_t* k_packed_t = nullptr;
      const uint16_t* v_packed_t = nullptr;
      const uint16_t* k_packed_pairs = nullptr;
#ifdef RELPOS_HAVE_BF16_TILES
      if constexpr (std::is_same_v<I, c10::BFloat16>) {
        if (w.tiles) {
          k_packed_t = amx_head_tile_transposed(w.k_head_t, hd.k, S, BK, j0, D);
          v_packed_t = amx_head_tile_transposed(w.v_head_t, hd.v, S, BK, j0, Dv);
          k_packed_pairs = amx_head_tile_pairs(w.k_head_pairs, hd.k, S, BK, j0, nk, D);
        }
      }
#endif
      if (low_gemms) {
        if constexpr (low) {
          // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T; dP_IJ (nq, nk) = dO_I (nq, Dv) @ V_J^T
          gemm_scores_low(w.tiles, nullptr, nq, nk, D, scale, w.q_rows, w.q_scaled, q_block, k_tile,
                          w.scores.data(), k_packed_t);
          gemm_scores_low(w.tiles, nullptr, nq, nk, Dv, T(1), w.do_rows, false, do_block, v_tile,
                          w.dp.data(), v_packed_t);
        }
      } else {
        const auto [kw, v_wide] = as_wide2<T, I>(k_tile, nk * D, w.k_wide, v_tile, nk * Dv,
                                                 w.v_wide);
        k_wide = kw;
        // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T
        gemm_nt<T>(nq, nk, D, scale, q_wide, k_wide, T(0), w.scores.data());
        // dP_IJ (nq, nk) = dO_I (nq, Dv) @ V_J^T
        gemm_nt<T>(nq, nk, Dv, T(1), do_wide, v_wide, T(0), w.dp.data());
      }
      T* pd = drop.on ? w.p_dropped.data() : w.scores.data();  // what multiplies V
      for (int64_t r = 0; r < nq; ++r) {
        backward_row<T, I>(g, hd, attn_bias, drop, inv_keep, w, pd, lse_block[r], r, i0 + r, j0,
                           j1);
        if (w.tiles) backward_pack_rows(w, nq, nk, pd, r, r + 1);
      }
      if (w.tiles) {
        backward_tile_gradients_packed(w, nq, nk, D, Dv, scale, k_tile, dv + j0 * Dv, dk + j0 * D,
                                    k_packed_pairs);
      } else if (low_gemms) {
        if constexpr (low) {
          convert(pd, w.p_low.data(), nq * nk);
          convert(w.dp.data(), w.ds_low.data(), nq * nk);
          // dV_J (nk, Dv) += P_IJ^T @ dO_I; dq_acc_I (nq, D) += dS_IJ @ K_J;
          // dK_J (nk, D) += scale · dS_IJ^T @ Q_I
          low_gemm<I>(true, false, nk, Dv, nq, T(1), w.p_low.data(), do_block, T(1),
                      dv + j0 * Dv);
          low_gemm<I>(false, false, nq, D, nk, T(1), w.ds_low.data(), k_tile, T(1),
                      w.dq_acc.data());
          low_gemm<I>(true, false, nk, D, nq, scale, w.ds_low.data(), q_block, T(1),
                      dk + j0 * D);
        }
      } else {
        // dV_J (nk, Dv) += P_IJ^T @ dO_I (nq, Dv)
        gemm_tn<T>(nk, Dv, nq, T(1), pd, do_wide, T(1), dv + j0 * Dv);
        // dq_acc_I (nq, D) += dS_IJ (nq, nk) @ K_J (nk, D)
        gemm_nn<T>(nq, D, nk, T(1), w.dp.data(), k_wide, T(1), w.dq_acc.data());
        // dK_J (nk, D) += scale · dS_IJ^T @ Q_I (nq, D)
        gemm_tn<T>(nk, D, nq, scale, w.dp.data(), q_wide, T(1), dk + j0 * D);
      }
    }
    backward_epilogue<T, I>(g, hd, w, i0, nq, scale, ak_finite, lse_block, q_wide, do_wide,
                            gr.dak, gr.dav, gr.dq + i0 * D);
  }
  if constexpr (low) {
    convert(dk, gr.dk, S * D);
    convert(dv, gr.dv, S * Dv);
  }
}

// Padded tasks: (batch, head), which own their dk, dv and table-gradient partials (B, H, R, ·).
template <typename T, typename I = T>
static void backward_impl(const Geometry& g, const Inputs<T, I>& in, const I* dout, const I* out,
                          const T* lse, T scale, const Dropout& drop, I* dq, I* dk, I* dv,
                          T* dak_part, T* dav_part, HalfGemms gemms = {}) {
  const int64_t L = g.L, S = g.S, D = g.D, Dv = g.Dv, R = g.R;
  const int64_t BQ = backward_query_block(L), BK = key_block_size(L, S);
  const TileGemm tiles = tile_gemms_of(gemms, BQ, BK, kAmxBackwardRows);

  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    BackwardBlock<T, I> w(BQ, BQ * BK, R, D, in.ak != nullptr, in.av != nullptr, drop.on, Dv,
                          BK, S, gemms.low, tiles);
    for (int64_t bh = begin; bh < stop; ++bh) {
      T* dak = in.ak ? dak_part + bh * R * D : nullptr;
      T* dav = in.av ? dav_part + bh * R * Dv : nullptr;
      if (dak) std::fill(dak, dak + R * D, T(0));
      if (dav) std::fill(dav, dav + R * Dv, T(0));
      const HeadGradients<T, I> gr{dout + bh * L * Dv, out + bh * L * Dv, lse + bh * L,
                                   dq + bh * L * D, dk + bh * S * D, dv + bh * S * Dv, dak, dav};
      backward_task<T, I>(g, head_of(g, in, drop, bh), gr, in.attn_bias, scale, in.ak_finite,
                          drop, w, BQ, BK);
    }
  });
}

// With tables, a varlen backward keeps one table-gradient partial per (group, head), a group
// being a run of consecutive sequences: at most this many groups, so that the partials stay
// O(H·R·D) (as for a padded batch of this many rows) however many sequences the call packs.
constexpr int64_t kVarlenGradientGroups = 64;

// The groups of a varlen backward, as their first sequences (n_groups + 1 entries, the last N):
// one per sequence without tables or with at most kVarlenGradientGroups sequences; otherwise
// consecutive runs of about equal work (L·S + L + S a sequence). Depends on the lengths alone,
// so the table gradients are summed in the same order at every thread count.
static std::vector<int64_t> varlen_gradient_groups(const VarlenCall& vc, bool tables) {
  const int64_t N = vc.pk.N;
  std::vector<int64_t> first;
  if (!tables || N <= kVarlenGradientGroups) {
    for (int64_t s = 0; s <= N; ++s) first.push_back(s);
    return first;
  }
  std::vector<double> work(N);
  double total = 0;
  for (int64_t s = 0; s < N; ++s) {
    const double L = static_cast<double>(vc.seqs[s].L), S = static_cast<double>(vc.seqs[s].S);
    work[s] = L * S + L + S;
    total += work[s];
  }
  first.push_back(0);
  double done = 0;
  for (int64_t s = 0; s < N; ++s) {
    // s opens the next group once the groups so far hold their share of the work
    const auto open = static_cast<int64_t>(first.size());
    if (s > 0 && open < kVarlenGradientGroups &&
        done >= total * static_cast<double>(open) / kVarlenGradientGroups)
      first.push_back(s);
    done += work[s];
  }
  first.push_back(N);
  return first;
}

// Varlen tasks: (sequence, head), which own their dk and dv rows (the spare rows of a key region
// past seqused_k included: zeroed), run by units (group, head): a unit zeroes its
// table-gradient partials (n_groups, H, R, ·) and runs the tasks of its group's sequences in
// order, each adding to them.
template <typename T, typename I = T>
static void backward_varlen_impl(const VarlenCall& vc, const std::vector<int64_t>& groups,
                                 const Inputs<T, I>& in, const I* dout, const I* out,
                                 const T* lse, T scale, const Dropout& drop, I* dq, I* dk, I* dv,
                                 T* dak_part, T* dav_part, HalfGemms gemms = {}) {
  const Packing& pk = vc.pk;
  const int64_t n_groups = static_cast<int64_t>(groups.size()) - 1, R = vc.R;
  int64_t S_max = 0;  // 16-bit inputs: the float dK and dV of the longest sequence
  if constexpr (!std::is_same_v<T, I>)
    for (const Geometry& g : vc.seqs) S_max = std::max(S_max, g.S);
  const TileGemm tiles = tile_gemms_of(gemms, vc.BQ, vc.BK, kAmxBackwardRows);

  at::parallel_for(0, n_groups * pk.H, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    BackwardBlock<T, I> w(vc.BQ, vc.tile, R, vc.D, in.ak != nullptr, in.av != nullptr, drop.on,
                          vc.Dv, vc.BK, S_max, gemms.low, tiles);
    for (int64_t unit = begin; unit < stop; ++unit) {
      const int64_t group = unit / pk.H, h = unit % pk.H;
      T* dak = in.ak ? dak_part + unit * R * vc.D : nullptr;
      T* dav = in.av ? dav_part + unit * R * vc.Dv : nullptr;
      if (dak) std::fill(dak, dak + R * vc.D, T(0));
      if (dav) std::fill(dav, dav + R * vc.Dv, T(0));
      for (int64_t s = groups[group]; s < groups[group + 1]; ++s) {
        const Geometry& g = vc.seqs[s];
        const int64_t qr = pk.q_row(s, h), kr = pk.k_row(s, h);
        const HeadGradients<T, I> gr{dout + qr * g.Dv, out + qr * g.Dv, lse + qr,
                                     dq + qr * g.D,    dk + kr * g.D,    dv + kr * g.Dv,
                                     dak,              dav};
        backward_task<T, I>(g, varlen_head(g, pk, in, s, h), gr, static_cast<const T*>(nullptr),
                            scale, in.ak_finite, drop, w, backward_query_block(g.L),
                            key_block_size(g.L, g.S));
        const int64_t region = pk.region(s);  // spare capacity [S, region): never read
        std::fill(gr.dk + g.S * g.D, gr.dk + region * g.D, I(0));
        std::fill(gr.dv + g.S * g.Dv, gr.dv + region * g.Dv, I(0));
      }
    }
  });
}

// ------------------------------------------------------------------------------------------
// Entry points

// Positions the kernels' int64 arithmetic on positions and offsets (p - left + 1, p + right,
// left + right + 1) stays exact for: |query_start|, L and S up to this, and windows narrowed to
// at most about twice this.
constexpr int64_t kMaxPosition = int64_t(1) << 60;

// The window (left, right) as the kernels use it. With a table it is the table's: R = left +
// right + 1 rows (checked without overflow). Without tables it changes nothing but where each
// row's segments split, and any int64 window is legal: it is narrowed to the offsets j - p the
// call has, [-(query_start + L - 1), S - 1 - query_start], before R is computed.
static void set_window(Geometry& g, const c10::optional<Tensor>& ak,
                       const c10::optional<Tensor>& av, const AttentionOptions& options) {
  const int64_t left = options.left, right = options.right;
  TORCH_CHECK(left >= 0 && right >= 0, "the window (left=", left, ", right=", right,
              ") must not be negative");
  TORCH_CHECK(g.L <= kMaxPosition && g.S <= kMaxPosition &&
                  options.query_start >= -kMaxPosition && options.query_start <= kMaxPosition,
              "query_start=", options.query_start, " is out of range");
  const c10::optional<Tensor>& table = ak.has_value() ? ak : av;
  if (table.has_value()) {
    for (const c10::optional<Tensor>* t : {&ak, &av})
      TORCH_CHECK(!t->has_value() || (*t)->dim() == 3, "tables must be 3-D (Hr, R, D)");
    const int64_t rows = table->size(1);
    TORCH_CHECK(left < rows && right == rows - 1 - left &&
                    (!ak.has_value() || !av.has_value() || av->size(1) == rows),
                "the window (left=", left, ", right=", right, ") needs left + right + 1 table "
                "rows, got ", rows);
    g.left = left;
    g.right = right;
  } else {
    g.left = std::min(left, std::max<int64_t>(g.query_start + g.L - 1, 0));
    g.right = std::min(right, std::max<int64_t>(g.S - 1 - g.query_start, 0));
  }
  g.R = g.left + g.right + 1;
  TORCH_CHECK(!table.has_value() || g.R * std::max(g.D, g.Dv) < (int64_t(1) << 31),
              "table too large");
}

// The tables' heads and widths (set_window checks their rows): (Hr, R, D) for rel_keys and
// (Hr, R, Dv) for rel_values, Hr 1 (shared) or H (per head).
static void check_tables(const c10::optional<Tensor>& ak, const c10::optional<Tensor>& av,
                         int64_t H, int64_t D, int64_t Dv) {
  for (const auto& [t, width] : {std::make_pair(&ak, D), std::make_pair(&av, Dv)}) {
    if (!t->has_value()) continue;
    const Tensor& table = **t;
    TORCH_CHECK(table.dim() == 3 && (table.size(0) == 1 || table.size(0) == H) &&
                    table.size(2) == width,
                "tables must be (1 or H, R, D) for rel_keys and (1 or H, R, Dv) for rel_values "
                "(H=", H, ", D=", D, ", Dv=", Dv, "), got ", table.sizes());
  }
}

static bool is_half_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The type a call computes in: float for 16-bit inputs (whose tables and masks come as float),
// the inputs' own otherwise.
static at::ScalarType compute_type(at::ScalarType t) {
  return is_half_precision(t) ? at::kFloat : t;
}

static void check_same_type(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "query, key and value must have one dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
}

// The backward's other inputs: grad_out and out of the query's dtype, lse of the compute type.
static void check_backward_types(const Tensor& q, const Tensor& go, const Tensor& o,
                                 const Tensor& lse) {
  TORCH_CHECK(go.scalar_type() == q.scalar_type() && o.scalar_type() == q.scalar_type(),
              "grad_out and out must have the query's dtype ", q.scalar_type(), ", got ",
              go.scalar_type(), " and ", o.scalar_type());
  TORCH_CHECK(lse.scalar_type() == compute_type(q.scalar_type()), "lse must be ",
              compute_type(q.scalar_type()), " for ", q.scalar_type(), " inputs, got ",
              lse.scalar_type());
}

static Geometry geometry(const Tensor& q, const Tensor& k, const Tensor& v,
                         const c10::optional<Tensor>& ak, const c10::optional<Tensor>& av,
                         const c10::optional<Tensor>& mask, const AttentionOptions& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "query, key, value must be 4-D");
  check_tables(ak, av, q.size(1), q.size(3), v.size(3));
  Geometry g;
  g.B = q.size(0);
  g.H = q.size(1);
  g.L = q.size(2);
  g.D = q.size(3);
  g.S = k.size(2);
  g.Dv = v.size(3);
  g.causal = options.is_causal;
  g.query_start = options.query_start;
  set_window(g, ak, av, options);
  g.Hr_k = ak.has_value() ? ak->size(0) : 1;
  g.Hr_v = av.has_value() ? av->size(0) : 1;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(0) == g.B && mask->size(1) == g.H &&
                    mask->size(2) == g.L && mask->size(3) == g.S,
                "attn_bias must be expanded to (B, H, L, S)");
    TORCH_CHECK(mask->scalar_type() == compute_type(q.scalar_type()),
                "attn_bias must be float for 16-bit inputs, else of the query's dtype");
    g.mB = mask->stride(0);
    g.mH = mask->stride(1);
    g.mL = mask->stride(2);
    g.mS = mask->stride(3);
  }
  return g;
}

template <typename T>
static bool all_finite(const T* x, int64_t n) {
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(x[i]);
  return finite;
}

template <typename T>
static const T* ptr_or_null(const c10::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

static c10::optional<Tensor> contig(const c10::optional<Tensor>& t) {
  if (!t.has_value()) return c10::nullopt;
  return t->contiguous();
}

// The float tables of a 16-bit call rounded to its type for the 16-bit GEMMs (exact for tables
// that were that type: the caller widened them), or none without those GEMMs.
static std::pair<c10::optional<Tensor>, c10::optional<Tensor>> tables_in(
    const c10::optional<Tensor>& ak, const c10::optional<Tensor>& av, at::ScalarType type,
    bool low_gemms) {
  auto in = [&](const c10::optional<Tensor>& t) -> c10::optional<Tensor> {
    if (!low_gemms || !t.has_value()) return c10::nullopt;
    return t->to(type).contiguous();
  };
  return {in(ak), in(av)};
}

// The inputs of a call with 16-bit q, k, v (type I): those as given, tables and masks as float,
// and, where the call runs the 16-bit GEMMs (`low`), the tables in I too (kept alive by
// `low_tables`).
template <typename I>
static Inputs<float, I> half_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const c10::optional<Tensor>& ak,
                                    const c10::optional<Tensor>& av,
                                    const c10::optional<Tensor>& kb,
                                    const c10::optional<Tensor>& attn_bias, bool low,
                                    std::pair<c10::optional<Tensor>, c10::optional<Tensor>>&
                                        low_tables) {
  Inputs<float, I> in{q.data_ptr<I>(),         k.data_ptr<I>(),         v.data_ptr<I>(),
                      ptr_or_null<float>(ak),  ptr_or_null<float>(av),  ptr_or_null<float>(kb),
                      ptr_or_null<float>(attn_bias)};
  if (ak) in.ak_finite = all_finite(in.ak, ak->numel());
  low_tables = tables_in(ak, av, q.scalar_type(), low);
  in.ak_low = ptr_or_null<I>(low_tables.first);
  in.av_low = ptr_or_null<I>(low_tables.second);
  return in;
}

template <typename T>
static Inputs<T> inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                        const c10::optional<Tensor>& ak, const c10::optional<Tensor>& av,
                        const c10::optional<Tensor>& kb, const c10::optional<Tensor>& attn_bias) {
  return {q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), ptr_or_null<T>(ak),
          ptr_or_null<T>(av), ptr_or_null<T>(kb), ptr_or_null<T>(attn_bias)};
}

// Sums the partials (n, H, R, width) of a table gradient (one per padded (batch, head) task, or
// per varlen (group, head) unit) into (Hr, R, width), in a fixed order.
template <typename T>
static Tensor reduce_table_gradient(const Tensor& part, int64_t Hr) {
  const int64_t n_outer = part.size(0), H = part.size(1), n = part.size(2) * part.size(3);
  auto res = at::zeros({Hr, part.size(2), part.size(3)}, part.options());
  const T* src = part.data_ptr<T>();
  T* dst = res.data_ptr<T>();
  for (int64_t b = 0; b < n_outer; ++b)
    for (int64_t h = 0; h < H; ++h) {
      T* d = dst + (Hr == 1 ? 0 : h) * n;
      const T* s = src + (b * H + h) * n;
      for (int64_t x = 0; x < n; ++x) d[x] += s[x];
    }
  return res;
}

// Returns out (B, H, L, Dv) and the logsumexp (B, H, L) (+inf where a row sees no key).
std::vector<Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                            const c10::optional<Tensor>& rel_keys,
                            const c10::optional<Tensor>& rel_values,
                            const c10::optional<Tensor>& key_bias,
                            const c10::optional<Tensor>& attn_bias,
                            const c10::optional<Tensor>& seed, const AttentionOptions& options) {
  auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values), kb = contig(key_bias);
  check_same_type(q, k, v);
  const Geometry g = geometry(q, k, v, ak, av, attn_bias, options);
  auto out = at::empty({g.B, g.H, g.L, g.Dv}, q.options());
  auto lse = at::empty({g.B, g.H, g.L}, q.options().dtype(compute_type(q.scalar_type())));
  const Dropout drop(options.dropout_p, seed);
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward_half", [&] {
      const HalfGemms gemms =
          for_query_blocks(half_gemms_now<scalar_t>(), forward_query_block(g.L, g.B * g.H));
      const bool low = gemms.low;
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto in = half_inputs<scalar_t>(q, k, v, ak, av, kb, attn_bias, low, low_tables);
      forward_impl<float, scalar_t>(g, in, static_cast<float>(options.scale), drop,
                                    out.data_ptr<scalar_t>(), lse.data_ptr<float>(), gemms);
    });
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward", [&] {
    const auto in = inputs<scalar_t>(q, k, v, ak, av, kb, attn_bias);
    forward_impl<scalar_t>(g, in, static_cast<scalar_t>(options.scale), drop,
                           out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

// Returns dq, dk, dv, d rel_keys, d rel_values (the last two empty for absent tables).
std::vector<Tensor> backward(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                             const Tensor& value, const c10::optional<Tensor>& rel_keys,
                             const c10::optional<Tensor>& rel_values,
                             const c10::optional<Tensor>& key_bias,
                             const c10::optional<Tensor>& attn_bias,
                             const c10::optional<Tensor>& seed, const Tensor& out,
                             const Tensor& lse, const AttentionOptions& options) {
  auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  auto go = grad_out.contiguous(), o = out.contiguous(), ls = lse.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values), kb = contig(key_bias);
  check_same_type(q, k, v);
  check_backward_types(q, go, o, ls);
  const Geometry g = geometry(q, k, v, ak, av, attn_bias, options);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const auto part = q.options().dtype(compute_type(q.scalar_type()));
  Tensor dak_part, dav_part, dak, dav;
  if (ak) dak_part = at::empty({g.B, g.H, g.R, g.D}, part);
  if (av) dav_part = at::empty({g.B, g.H, g.R, g.Dv}, part);
  const Dropout drop(options.dropout_p, seed);
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward_half", [&] {
      const HalfGemms gemms =
          for_query_blocks(half_gemms_now<scalar_t>(), backward_query_block(g.L));
      const bool low = gemms.low;
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto in = half_inputs<scalar_t>(q, k, v, ak, av, kb, attn_bias, low, low_tables);
      backward_impl<float, scalar_t>(
          g, in, go.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), ls.data_ptr<float>(),
          static_cast<float>(options.scale), drop, dq.data_ptr<scalar_t>(),
          dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
          ak ? dak_part.data_ptr<float>() : nullptr, av ? dav_part.data_ptr<float>() : nullptr,
          gemms);
      if (ak) dak = reduce_table_gradient<float>(dak_part, g.Hr_k);
      if (av) dav = reduce_table_gradient<float>(dav_part, g.Hr_v);
    });
    return {dq, dk, dv, ak ? dak : at::empty({0}, part), av ? dav : at::empty({0}, part)};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward", [&] {
    auto in = inputs<scalar_t>(q, k, v, ak, av, kb, attn_bias);
    if (ak) in.ak_finite = all_finite(in.ak, ak->numel());
    backward_impl<scalar_t>(g, in, go.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(),
                            ls.data_ptr<scalar_t>(), static_cast<scalar_t>(options.scale), drop,
                            dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                            dv.data_ptr<scalar_t>(),
                            ak ? dak_part.data_ptr<scalar_t>() : nullptr,
                            av ? dav_part.data_ptr<scalar_t>() : nullptr);
    if (ak) dak = reduce_table_gradient<scalar_t>(dak_part, g.Hr_k);
    if (av) dav = reduce_table_gradient<scalar_t>(dav_part, g.Hr_v);
  });
  return {dq, dk, dv, ak ? dak : at::empty({0}, q.options()),
          av ? dav : at::empty({0}, q.options())};
}

// The keep mask of dropout row `row` over keys [0, S) (all kept without dropout).
static void keep_row(const Dropout& drop, int64_t row, int64_t S, bool* keep) {
  uint32_t k1 = 0, k2 = 0;
  if (drop.on) drop.row_keys(row, k1, k2);
  for (int64_t j = 0; j < S; ++j)
    keep[j] = !drop.on || Dropout::keep(static_cast<uint32_t>(drop.key_offset + j), k1, k2,
                                        drop.threshold);
}

// Returns the keep mask (B, H, L, S) of a padded call.
Tensor dropout_mask(const Tensor& seed, int64_t B, int64_t H, int64_t L, int64_t S,
                    double dropout_p) {
  const Dropout drop(dropout_p, seed);
  auto mask = at::empty({B, H, L, S}, at::TensorOptions().dtype(at::kBool));
  bool* mp = mask.data_ptr<bool>();
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < L; ++i)
      keep_row(drop, drop.first_row(bh, L) + i, S, mp + (bh * L + i) * S);
  return mask;
}

// ------------------------------------------------------------------------------------------
// Varlen entry points

// The cumulative lengths of a varlen call (N + 1 entries: 0, then each sequence's end), checked
// so that the kernels stay inside the packed rows: 1-D int64 on the CPU, at least one entry,
// from 0, non-decreasing (the caller checks the end). Returned contiguous.
static Tensor checked_cu_seqlens(const Tensor& cu, const char* name) {
  TORCH_CHECK(cu.dim() == 1 && cu.scalar_type() == at::kLong && cu.device().is_cpu(), name,
              " must be a 1-D int64 CPU tensor, got ", cu.scalar_type(), " ", cu.sizes(), " on ",
              cu.device());
  TORCH_CHECK(cu.numel() >= 1, name, " must hold at least its first entry, 0");
  auto c = cu.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  TORCH_CHECK(p[0] == 0, name, " must start at 0, got ", p[0]);
  for (int64_t s = 1; s < c.numel(); ++s)
    TORCH_CHECK(p[s] >= p[s - 1], name, " must be non-decreasing, got ", p[s - 1], " then ",
                p[s], " at entry ", s);
  return c;
}

// The keys each sequence uses (seqused_k), checked against the packing so that the kernels
// stay inside every sequence's key region: 1-D int64 on the CPU, N entries, each in
// [0, cu_k[s+1] - cu_k[s]]. Returned contiguous (undefined without seqused_k); `pk` points at it.
static Tensor checked_seqused(const c10::optional<Tensor>& seqused_k, Packing& pk) {
  if (!seqused_k.has_value()) return Tensor();
  const Tensor& u = *seqused_k;
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kLong && u.device().is_cpu(),
              "seqused_k must be a 1-D int64 CPU tensor, got ", u.scalar_type(), " ", u.sizes(),
              " on ", u.device());
  TORCH_CHECK(u.numel() == pk.N, "seqused_k must hold one entry per sequence (N = ", pk.N,
              "), got ", u.numel());
  auto c = u.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  for (int64_t s = 0; s < pk.N; ++s)
    TORCH_CHECK(p[s] >= 0 && p[s] <= pk.region(s), "seqused_k[", s, "] must be in [0, ",
                pk.region(s), "] (the sequence's key region, cu_seqlens_k[", s + 1,
                "] - cu_seqlens_k[", s, "]), got ", p[s]);
  pk.used_k = p;
  return c;
}

// The packing of a varlen call from its checked cumulative lengths, which must have one length
// (N + 1) and end at the packed rows' counts Tq and Tk (< 0: at whatever they end); every
// sequence uses its whole key region until checked_seqused says otherwise.
static Packing packing(const Tensor& cu_q, const Tensor& cu_k, int64_t H, int64_t Tq,
                       int64_t Tk) {
  TORCH_CHECK(cu_q.numel() == cu_k.numel(), "cu_seqlens_q and cu_seqlens_k must have one length "
              "(N + 1), got ", cu_q.numel(), " and ", cu_k.numel());
  Packing pk;
  pk.N = cu_q.numel() - 1;
  pk.H = H;
  pk.cu_q = cu_q.data_ptr<int64_t>();
  pk.cu_k = cu_k.data_ptr<int64_t>();
  pk.Tq = pk.cu_q[pk.N];
  pk.Tk = pk.cu_k[pk.N];
  TORCH_CHECK(Tq < 0 || pk.Tq == Tq, "cu_seqlens_q must end at the query's rows, ", Tq, ", got ",
              pk.Tq);
  TORCH_CHECK(Tk < 0 || pk.Tk == Tk, "cu_seqlens_k must end at the key's rows, ", Tk, ", got ",
              pk.Tk);
  return pk;
}

// A varlen call from its tensors' shapes (query (Tq, H, D), key (Tk, H, D), value (Tk, H, Dv),
// the checked cumulative lengths and the keys in use, `used` (from checked_seqused, or an
// undefined tensor: every key), which must outlive it), with every check that keeps the kernels
// inside them; each sequence's geometry bottom-right aligned to the keys it uses
// (query_start = S - L) and its window narrowed as set_window does.
static VarlenCall varlen_call(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& cu_q, const Tensor& cu_k,
                              const c10::optional<Tensor>& seqused_k, Tensor& used,
                              const c10::optional<Tensor>& ak, const c10::optional<Tensor>& av,
                              const AttentionOptions& options) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "query, key, value must be 3-D (T, H, D)");
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu(), "the native kernels take CPU tensors, got ", t->device());
  for (const c10::optional<Tensor>* t : {&ak, &av})
    TORCH_CHECK(!t->has_value() || (*t)->device().is_cpu(),
                "the native kernels take CPU tensors, got ", (*t)->device());
  const int64_t H = q.size(1);
  TORCH_CHECK(k.size(1) == H && v.size(1) == H && k.size(2) == q.size(2) &&
                  v.size(0) == k.size(0),
              "query (Tq, H, D), key (Tk, H, D) and value (Tk, H, Dv) do not match: ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(options.query_start == 0, "a varlen call aligns each sequence bottom-right: "
              "query_start must be 0, got ", options.query_start);
  VarlenCall vc;
  vc.pk = packing(cu_q, cu_k, H, q.size(0), k.size(0));
  used = checked_seqused(seqused_k, vc.pk);
  vc.D = q.size(2);
  vc.Dv = v.size(2);
  check_tables(ak, av, H, vc.D, vc.Dv);
  Geometry base;
  base.B = 1;
  base.H = H;
  base.L = base.S = base.query_start = 0;
  base.D = vc.D;
  base.Dv = vc.Dv;
  base.causal = options.is_causal;
  base.Hr_k = ak.has_value() ? ak->size(0) : 1;
  base.Hr_v = av.has_value() ? av->size(0) : 1;
  set_window(base, ak, av, options);  // the tables' rows; R of every sequence with tables
  vc.R = base.R;
  vc.heads = vc.pk.N * H;
  vc.seqs.reserve(vc.pk.N);
  for (int64_t s = 0; s < vc.pk.N; ++s) {
    Geometry g = base;
    g.L = vc.pk.queries(s);
    g.S = vc.pk.keys(s);
    g.query_start = g.S - g.L;
    AttentionOptions aligned = options;
    aligned.query_start = g.query_start;
    set_window(g, ak, av, aligned);
    vc.seqs.push_back(g);
    if (g.L == 0) continue;
    // room for either direction's blocks
    const int64_t BQ = std::max(forward_query_block(g.L, vc.heads), backward_query_block(g.L));
    vc.BQ = std::max(vc.BQ, BQ);
    vc.tile = std::max(vc.tile, BQ * key_block_size(g.L, g.S));
    vc.BK = std::max(vc.BK, key_block_size(g.L, g.S));
    vc.R = std::max(vc.R, g.R);
  }
  return vc;
}

// Returns out (Tq, H, Dv) and the logsumexp (H, Tq) (+inf where a row sees no key) of a varlen
// call: query (Tq, H, D), key (Tk, H, D), value (Tk, H, Dv) in any strides; sequence s holds
// the query rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) and the key rows [cu_seqlens_k[s],
// cu_seqlens_k[s+1]) (only the first seqused_k[s] of them with seqused_k, an (N) int64 tensor,
// or None), bottom-right aligned (options.query_start must be 0). The kernels hold q, k, v and
// out as (H, T, ·) contiguous, one block of rows per (sequence, head): one copy of each input
// unless it is given so, and one of out back to (Tq, H, Dv).
std::vector<Tensor> forward_varlen(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                   const c10::optional<Tensor>& seqused_k,
                                   const c10::optional<Tensor>& rel_keys,
                                   const c10::optional<Tensor>& rel_values,
                                   const c10::optional<Tensor>& seed,
                                   const AttentionOptions& options) {
  auto cu_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  auto cu_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  Tensor used;
  const VarlenCall vc =
      varlen_call(query, key, value, cu_q, cu_k, seqused_k, used, rel_keys, rel_values, options);
  auto q = query.transpose(0, 1).contiguous(), k = key.transpose(0, 1).contiguous(),
       v = value.transpose(0, 1).contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values);
  check_same_type(q, k, v);
  auto out = at::empty({vc.pk.H, vc.pk.Tq, vc.Dv}, q.options());
  auto lse = at::empty({vc.pk.H, vc.pk.Tq}, q.options().dtype(compute_type(q.scalar_type())));
  const Dropout drop(options.dropout_p, seed);
  TORCH_CHECK(!drop.placed, "a varlen call takes a dropout seed of two int64 (no placement)");
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward_varlen_half", [&] {
      const HalfGemms gemms = for_query_blocks(half_gemms_now<scalar_t>(), vc.BQ);
      const bool low = gemms.low;
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto in = half_inputs<scalar_t>(q, k, v, ak, av, c10::nullopt, c10::nullopt, low,
                                            low_tables);
      forward_varlen_impl<float, scalar_t>(vc, in, static_cast<float>(options.scale), drop,
                                           out.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                                           gemms);
    });
    return {out.transpose(0, 1).contiguous(), lse};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward_varlen", [&] {
    const auto in = inputs<scalar_t>(q, k, v, ak, av, c10::nullopt, c10::nullopt);
    forward_varlen_impl<scalar_t>(vc, in, static_cast<scalar_t>(options.scale), drop,
                                  out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out.transpose(0, 1).contiguous(), lse};
}

// Returns dq (Tq, H, D), dk (Tk, H, D), dv (Tk, H, Dv), d rel_keys, d rel_values (the last two
// empty for absent tables) of a varlen call: grad_out and out (Tq, H, Dv), lse (H, Tq), the
// rest as forward_varlen takes them (dk and dv are 0 in the rows past seqused_k). Layout
// inside as in forward_varlen.
std::vector<Tensor> backward_varlen(const Tensor& grad_out, const Tensor& query,
                                    const Tensor& key, const Tensor& value,
                                    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                    const c10::optional<Tensor>& seqused_k,
                                    const c10::optional<Tensor>& rel_keys,
                                    const c10::optional<Tensor>& rel_values,
                                    const c10::optional<Tensor>& seed, const Tensor& out,
                                    const Tensor& lse, const AttentionOptions& options) {
  auto cu_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  auto cu_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  Tensor used;
  const VarlenCall vc =
      varlen_call(query, key, value, cu_q, cu_k, seqused_k, used, rel_keys, rel_values, options);
  const int64_t H = vc.pk.H, Tq = vc.pk.Tq, Tk = vc.pk.Tk;
  for (const Tensor* t : {&grad_out, &out})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == Tq && t->size(1) == H && t->size(2) == vc.Dv,
                "grad_out and out must be (Tq, H, Dv) = (", Tq, ", ", H, ", ", vc.Dv, "), got ",
                t->sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == H && lse.size(1) == Tq, "lse must be (H, Tq) = (",
              H, ", ", Tq, "), got ", lse.sizes());
  auto q = query.transpose(0, 1).contiguous(), k = key.transpose(0, 1).contiguous(),
       v = value.transpose(0, 1).contiguous();
  auto go = grad_out.transpose(0, 1).contiguous(), o = out.transpose(0, 1).contiguous();
  auto ls = lse.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values);
  check_same_type(q, k, v);
  check_backward_types(q, go, o, ls);
  auto dq = at::empty({H, Tq, vc.D}, q.options()), dk = at::empty({H, Tk, vc.D}, q.options()),
       dv = at::empty({H, Tk, vc.Dv}, q.options());
  const std::vector<int64_t> groups = varlen_gradient_groups(vc, ak || av);
  const auto n_groups = static_cast<int64_t>(groups.size()) - 1;
  const auto part = q.options().dtype(compute_type(q.scalar_type()));
  Tensor dak_part, dav_part, dak, dav;
  if (ak) dak_part = at::empty({n_groups, H, vc.R, vc.D}, part);
  if (av) dav_part = at::empty({n_groups, H, vc.R, vc.Dv}, part);
  const Dropout drop(options.dropout_p, seed);
  TORCH_CHECK(!drop.placed, "a varlen call takes a dropout seed of two int64 (no placement)");
  auto grads = [&]() -> std::vector<Tensor> {
    return {dq.transpose(0, 1).contiguous(), dk.transpose(0, 1).contiguous(),
            dv.transpose(0, 1).contiguous(), ak ? dak : at::empty({0}, part),
            av ? dav : at::empty({0}, part)};
  };
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward_varlen_half", [&] {
      const HalfGemms gemms = for_query_blocks(half_gemms_now<scalar_t>(), vc.BQ);
      const bool low = gemms.low;
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto in = half_inputs<scalar_t>(q, k, v, ak, av, c10::nullopt, c10::nullopt, low,
                                            low_tables);
      backward_varlen_impl<float, scalar_t>(
          vc, groups, in, go.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), ls.data_ptr<float>(),
          static_cast<float>(options.scale), drop, dq.data_ptr<scalar_t>(),
          dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
          ak ? dak_part.data_ptr<float>() : nullptr, av ? dav_part.data_ptr<float>() : nullptr,
          gemms);
      if (ak) dak = reduce_table_gradient<float>(dak_part, ak->size(0));
      if (av) dav = reduce_table_gradient<float>(dav_part, av->size(0));
    });
    return grads();
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward_varlen", [&] {
    auto in = inputs<scalar_t>(q, k, v, ak, av, c10::nullopt, c10::nullopt);
    if (ak) in.ak_finite = all_finite(in.ak, ak->numel());
    backward_varlen_impl<scalar_t>(vc, groups, in, go.data_ptr<scalar_t>(),
                                   o.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
                                   static_cast<scalar_t>(options.scale), drop,
                                   dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                                   dv.data_ptr<scalar_t>(),
                                   ak ? dak_part.data_ptr<scalar_t>() : nullptr,
                                   av ? dav_part.data_ptr<scalar_t>() : nullptr);
    if (ak) dak = reduce_table_gradient<scalar_t>(dak_part, ak->size(0));
    if (av) dav = reduce_table_gradient<scalar_t>(dav_part, av->size(0));
  });
  return grads();
}

// Returns the keep masks of a varlen call with H heads, one (H, L_s, S_s) per sequence (S_s the
// keys it uses: seqused_k[s] with seqused_k): query i of sequence s, head h, is dropout row
// h * Tq + cu_seqlens_q[s] + i (Packing::q_row), key j its index within the sequence.
std::vector<Tensor> dropout_mask_varlen(const Tensor& seed, const Tensor& cu_seqlens_q,
                                        const Tensor& cu_seqlens_k,
                                        const c10::optional<Tensor>& seqused_k, int64_t H,
                                        double dropout_p) {
  TORCH_CHECK(H >= 0, "the number of heads must not be negative, got ", H);
  auto cu_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  auto cu_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  Packing pk = packing(cu_q, cu_k, H, -1, -1);
  const Tensor used = checked_seqused(seqused_k, pk);
  const Dropout drop(dropout_p, seed);
  TORCH_CHECK(!drop.placed, "a varlen call takes a dropout seed of two int64 (no placement)");
  std::vector<Tensor> masks;
  for (int64_t s = 0; s < pk.N; ++s) {
    const int64_t L = pk.queries(s), S = pk.keys(s);
    auto mask = at::empty({H, L, S}, at::TensorOptions().dtype(at::kBool));
    bool* mp = mask.data_ptr<bool>();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) keep_row(drop, pk.q_row(s, h) + i, S, mp + (h * L + i) * S);
    masks.push_back(mask);
  }
  return masks;
}

// The BLAS the kernels call and the 16-bit GEMMs libtorch offers them here ("bf16", "fp16",
// comma-separated, or "none"), e.g. "blas=mkl amx=bf16 avx512bf16=bf16 half_gemm=bf16,fp16".
// What a bfloat16 call made now (this environment) runs its GEMMs on: "amx", "avx512bf16",
// "mkl" or "widened".
std::string bf16_gemm_name() {
  switch (bf16_gemm()) {
    case Bf16Gemm::kAmx: return "amx";
    case Bf16Gemm::kDot: return "avx512bf16";
    case Bf16Gemm::kMkl: return "mkl";
    default: return "widened";
  }
}

std::string build_info() {
  std::string info = aten_gemm_on() ? "blas=aten" : "blas=mkl";
  std::string half;
  if (has_low_gemm<c10::BFloat16>()) half = "bf16";
  if (has_low_gemm<c10::Half>()) half += half.empty() ? "fp16" : ",fp16";
  // the packed-tile GEMMs of bfloat16 calls: AMX (built for this CPU and granted by the OS),
  // VDPBF16PS (built for a CPU with AVX512-BF16)
  info += amx_granted() ? " amx=bf16" : " amx=none";
#ifdef RELPOS_HAVE_BF16_TILES
  info += " avx512bf16=bf16";
#else
  info += " avx512bf16=none";
#endif
  info += vec_sgemm_on() ? " sgemm=vec" : " sgemm=blas";
  // the float32 vector code the row passes, the GEMM blocks and the decode kernels run on
#if defined(__AVX512F__)
  info += " vectors=avx512";
#elif defined(RELPOS_VEC_FLOAT)
  info += " vectors=avx2";
#else
  info += " vectors=none";
#endif
  return info + " half_gemm=" + (half.empty() ? "none" : half);
}

// One query per (batch, head) over S cached keys, float32: out[b, h] = softmax(scale · q ·
// k_j^T, the keys key_mask hides at -inf) @ v (a decode step's attention over keys and values
// that already hold their relative rows). q (B, H, D) and out (B, H, Dv) any strides of whole
// rows; k (B, H, S, D) and v (B, H, S, Dv) with contiguous rows (a cache's first S positions);
// key_mask (B, S) bool or null. Each head streams its keys once for the scores and its values
// once for the sum (SDPA's CPU kernel, blocking for many queries, read them at about half the
// memory's rate at one query). A head whose keys are all hidden gets zeros.
void decode_attention_f32(const float* q, const int64_t q_s[2], const float* k,
                          const int64_t k_s[3], const float* v, const int64_t v_s[3],
                          const bool* key_mask, int64_t B, int64_t H, int64_t S, int64_t D,
                          int64_t Dv, float scale, float* out, const int64_t o_s[2]) {
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(static_cast<size_t>(std::max<int64_t>(S, 1)));
    std::vector<float> acc(static_cast<size_t>(Dv));
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qr = q + b * q_s[0] + h * q_s[1];
      const float* kh = k + b * k_s[0] + h * k_s[1];
      const float* vh = v + b * v_s[0] + h * v_s[1];
      const bool* mk = key_mask != nullptr ? key_mask + b * S : nullptr;
      float mx = ninf;
      for (int64_t j = 0; j < S; ++j) {
        const float* kr = kh + j * k_s[2];
        float dot = 0.0f;
#if defined(RELPOS_VEC_FLOAT)
        VecF::V a = VecF::set1(0.0f);
        int64_t d = 0;
        for (; d + VecF::W <= D; d += VecF::W)
          a = VecF::fmadd(VecF::load(qr + d), VecF::load(kr + d), a);
        if (d < D) {
          const auto m = VecF::tail(D - d);
          a = VecF::fmadd(VecF::load_tail(qr + d, m, VecF::set1(0.0f)),
                          VecF::load_tail(kr + d, m, VecF::set1(0.0f)), a);
        }
        dot = VecF::reduce_add(a);
#else
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
#endif
        s[j] = mk != nullptr && !mk[j] ? ninf : dot * scale;
        mx = std::max(mx, s[j]);
      }
      float* o = out + b * o_s[0] + h * o_s[1];
      if (mx == ninf) {
        std::fill(o, o + Dv, 0.0f);
        continue;
      }
      const float sum = exp_sum<float>(s.data(), S, mx);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < S; ++j) {
        const float pj = s[j];
        if (pj == 0.0f) continue;
        const float* vr = vh + j * v_s[2];
#if defined(RELPOS_VEC_FLOAT)
        const VecF::V pv = VecF::set1(pj);
        int64_t d = 0;
        for (; d + VecF::W <= Dv; d += VecF::W)
          VecF::store(acc.data() + d,
                      VecF::fmadd(pv, VecF::load(vr + d), VecF::load(acc.data() + d)));
        for (; d < Dv; ++d) acc[d] = std::fma(pj, vr[d], acc[d]);
#else
        for (int64_t d = 0; d < Dv; ++d) acc[d] = std::fma(pj, vr[d], acc[d]);
#endif
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < Dv; ++d) o[d] = acc[d] * inv;
    }
  });
}

// The panel linears of a decode step (decode_step.cpp's pack_panels: panel t holds, for
// k = 0 .. K-1, the 16 weights w[16t .. 16t + 15, k]). acc[r, 0..15] = x[r, :] @ panel for
// the R rows of x (row stride K): each x[r, k] broadcast against the panel's row k, the
// panel read once as a stream.
constexpr int64_t kPanel = 16;

template <int R>
static inline void panel_rows(const float* x, int64_t K, const float* panel, float* acc) {
#if defined(RELPOS_VEC_FLOAT)
  // the float32 GEMMs' register block: acc (R, 16) = x (R, K) @ panel (K, 16), streamed
  vec_gemm_block<R, kPanel / VecF::W, false, true>(K, x, K, 1, panel, kPanel, acc, kPanel, 1.0f,
                                                   false, VecF::tail(VecF::W));
#else
  float a[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c) a[r][c] += x[r * K + k] * panel[k * kPanel + c];
  for (int r = 0; r < R; ++r) std::copy(a[r], a[r] + kPanel, acc + r * kPanel);
#endif
}

// y (M, N; row stride N) = x (M, K) @ weight^T + bias (or none) from NP panels: each panel's
// outputs for 8 rows at a time, the panels split over the threads.
void panel_linear_f32(const float* x, int64_t M, int64_t K, const float* panels, int64_t NP,
                      const float* bias, int64_t N, float* y) {
  at::parallel_for(0, NP, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[8 * kPanel];
    for (int64_t t = begin; t < end; ++t) {
      const float* panel = panels + t * K * kPanel;
      const int64_t c0 = t * kPanel, nc = std::min(kPanel, N - c0);
      for (int64_t r0 = 0; r0 < M; r0 += 8) {
        const int64_t rows = std::min<int64_t>(8, M - r0);
        const float* xr = x + r0 * K;
        switch (rows) {
          case 1: panel_rows<1>(xr, K, panel, acc); break;
          case 2: panel_rows<2>(xr, K, panel, acc); break;
          case 3: panel_rows<3>(xr, K, panel, acc); break;
          case 4: panel_rows<4>(xr, K, panel, acc); break;
          case 5: panel_rows<5>(xr, K, panel, acc); break;
          case 6: panel_rows<6>(xr, K, panel, acc); break;
          case 7: panel_rows<7>(xr, K, panel, acc); break;
          default: panel_rows<8>(xr, K, panel, acc); break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = y + (r0 + r) * N + c0;
          for (int64_t c = 0; c < nc; ++c)
            dst[c] = bias != nullptr ? acc[r * kPanel + c] + bias[c0 + c] : acc[r * kPanel + c];
        }
      }
    }
  });
}

}  // namespace relpos_native

namespace relpos_decode {
void bind(pybind11::module& m);  // decode_step.cpp: the DecodeLayers class
}  // namespace relpos_decode

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  relpos_decode::bind(m);
  using relpos_native::AttentionOptions;
  // module_local: two builds of these kernels (two variants, a cache's and a prebuilt one)
  // can be loaded in one process without their types colliding.
  py::class_<AttentionOptions>(m, "AttentionOptions", py::module_local(),
                               "The scalar options of one call (keywords only, read-only).")
      .def(py::init([](int64_t left, int64_t right, bool is_causal, double scale,
                       int64_t query_start, double dropout_p) {
             return AttentionOptions{left, right, is_causal, scale, query_start, dropout_p};
           }),
           py::kw_only(), py::arg("left"), py::arg("right"), py::arg("is_causal"),
           py::arg("scale"), py::arg("query_start"), py::arg("dropout_p"))
      .def_readonly("left", &AttentionOptions::left)
      .def_readonly("right", &AttentionOptions::right)
      .def_readonly("is_causal", &AttentionOptions::is_causal)
      .def_readonly("scale", &AttentionOptions::scale)
      .def_readonly("query_start", &AttentionOptions::query_start)
      .def_readonly("dropout_p", &AttentionOptions::dropout_p)
      .def("__repr__", [](const AttentionOptions& o) {
        return "AttentionOptions(left=" + std::to_string(o.left) +
               ", right=" + std::to_string(o.right) +
               ", is_causal=" + (o.is_causal ? "True" : "False") +
               ", scale=" + std::to_string(o.scale) +
               ", query_start=" + std::to_string(o.query_start) +
               ", dropout_p=" + std::to_string(o.dropout_p) + ")";
      });
  // The kernels run without the GIL (arguments are converted before, results after), so
  // Python threads calling them run concurrently.
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("forward", &relpos_native::forward, "relpos native forward", py::arg("query"),
        py::arg("key"), py::arg("value"), py::arg("rel_keys"), py::arg("rel_values"),
        py::arg("key_bias"), py::arg("attn_bias"), py::arg("seed"), py::arg("options"),
        no_gil());
  m.def("backward", &relpos_native::backward, "relpos native backward", py::arg("grad_out"),
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("rel_keys"),
        py::arg("rel_values"), py::arg("key_bias"), py::arg("attn_bias"), py::arg("seed"),
        py::arg("out"), py::arg("lse"), py::arg("options"), no_gil());
  m.def("dropout_mask", &relpos_native::dropout_mask, "the keep mask of a dropout seed",
        no_gil());
  m.def("forward_varlen", &relpos_native::forward_varlen, "relpos native varlen forward",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("seqused_k"), py::arg("rel_keys"),
        py::arg("rel_values"), py::arg("seed"), py::arg("options"), no_gil());
  m.def("backward_varlen", &relpos_native::backward_varlen, "relpos native varlen backward",
        py::arg("grad_out"), py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_k"),
        py::arg("rel_keys"), py::arg("rel_values"), py::arg("seed"), py::arg("out"),
        py::arg("lse"), py::arg("options"), no_gil());
  m.def("dropout_mask_varlen", &relpos_native::dropout_mask_varlen,
        "the keep masks of a dropout seed over a varlen call, one (H, L, S) per sequence",
        py::arg("seed"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_k"),
        py::arg("num_heads"), py::arg("dropout_p"), no_gil());
  m.def("build_info", &relpos_native::build_info, "how the kernels were built");
  m.def("bf16_gemm", &relpos_native::bf16_gemm_name,
        "what a bfloat16 call runs its GEMMs on now: amx, avx512bf16, mkl or widened");
}
