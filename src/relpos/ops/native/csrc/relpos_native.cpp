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
// Attention dropout uses a counter-based hash of (seed, head, query, key), so the backward
// regenerates the forward's mask and `dropout_mask` exposes it.
//
// Table gradients: one partial per (batch, head) task, reduced afterwards in a fixed order:
// deterministic whatever the thread count. dk and dv are owned by their (batch, head) task.
//
// GEMMs: MKL's sgemm_/dgemm_ as exported by libtorch (RELPOS_HAVE_BLAS; inside the tasks'
// OpenMP region MKL runs on the calling thread, as in torch's own flash kernel); a plain C++
// fallback otherwise.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace relpos_native {

using at::Tensor;

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
}
#endif

template <typename T>
static void gemm_fallback(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha,
                          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C,
                          int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    T* c = C + i * ldc;
    if (beta == T(0)) {
      for (int64_t j = 0; j < N; ++j) c[j] = T(0);
    } else if (beta != T(1)) {
      for (int64_t j = 0; j < N; ++j) c[j] *= beta;
    }
    for (int64_t kk = 0; kk < K; ++kk) {
      const T a = alpha * (ta ? A[kk * lda + i] : A[i * lda + kk]);
      if (a == T(0)) continue;
      if (!tb) {
        const T* b = B + kk * ldb;
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
      } else {
        for (int64_t j = 0; j < N; ++j) c[j] += a * B[j * ldb + kk];
      }
    }
  }
}

template <typename T>
static inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                        int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
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
#else
  gemm_fallback(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

// ------------------------------------------------------------------------------------------
// exp: a vectorizable exp for float (Cody-Waite reduction, degree-6 polynomial; relative error
// about 2 ulp), exact std::exp for double. exp(-inf) = 0 and exp of anything below the float
// range is 0, at full speed (no slow underflow path).

static inline float exp_float(float x) {
  const float hi = 88.3762626647949f, lo = -87.3365447504019f;
  const bool under = x < lo;  // -inf included
  x = std::min(std::max(x, lo), hi);
  // Round x * log2(e) to the nearest integer n with the 1.5 * 2^23 trick (vectorizes; no
  // call to roundf): the low bits of t hold n.
  const float magic = 12582912.0f;
  const float t = x * 1.44269504088896341f + magic;
  const float n = t - magic;
  int32_t tb;
  std::memcpy(&tb, &t, sizeof(tb));
  const int32_t ni = tb - 0x4B400000;  // the bits of 1.5 * 2^23
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t e = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  const float out = y * scale;
  return under ? 0.0f : out;
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
// per row), so forward, backward and `dropout_mask` produce the same keep mask.

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
  int64_t L = 0;

  Dropout(double p, const c10::optional<Tensor>& seed, int64_t L_) : L(L_) {
    if (p > 0.0) {
      TORCH_CHECK(seed.has_value() && seed->numel() == 2 && seed->scalar_type() == at::kLong,
                  "dropout needs a seed tensor of two int64");
      auto s = seed->contiguous();
      const int64_t* sp = s.data_ptr<int64_t>();
      seed0 = static_cast<uint64_t>(sp[0]);
      seed1 = static_cast<uint64_t>(sp[1]);
      on = true;
      const double t = std::ldexp(p, 32);
      threshold = t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
      inv_keep = 1.0 / (1.0 - p);
    }
  }

  // The two 32-bit keys of row (bh, i).
  inline void row_keys(int64_t bh, int64_t i, uint32_t& k1, uint32_t& k2) const {
    const uint64_t z = mix64(seed0 ^ mix64(seed1 + static_cast<uint64_t>(bh * L + i) *
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
// Problem geometry

struct Geometry {
  int64_t B, H, L, S, D, Dv, R, left, right, query_start, Hr_k, Hr_v;
  bool causal;
  // A dense additive mask (B, H, L, S) in any strides (0 where broadcast), or none.
  int64_t mB = 0, mH = 0, mL = 0, mS = 0;

  // Segments of row position p within key block [j0, j1): far-left [j0, fl), band [fl, bd),
  // far-right [bd, end). end < j1 where the causal mask hides the rest.
  inline void segments(int64_t p, int64_t j0, int64_t j1, int64_t& fl, int64_t& bd,
                       int64_t& end) const {
    end = causal ? std::min(j1, p + 1) : j1;
    if (end < j0) end = j0;
    fl = std::min(std::max(p - left + 1, j0), end);
    bd = std::min(std::max(p + right, fl), end);
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
};

static int64_t query_block_size(int64_t L) {
  return L <= 32 ? std::max<int64_t>(L, 1) : 64;
}

// Keys per block: 512 (torch's flash kernel's size); a few queries over many keys (a decode
// step) take their whole rows in one block of at most 64K scores (no online rescaling).
static int64_t key_block_size(int64_t L, int64_t S) {
  if (L <= 8) return std::min<int64_t>(S, std::max<int64_t>(512, 65536 / std::max<int64_t>(L, 1)));
  return std::min<int64_t>(S, 512);
}

// ------------------------------------------------------------------------------------------
// Score rows of one tile. `s` holds scale * q . k for keys [j0, j1) of the row at position p.
// The relative key term is added to the band only: a far segment's constant (QA[i, 0] or
// QA[i, R-1]) is folded into its max and its exp offset, so far keys cost no extra pass.

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

// max(a, b), NaN if either is.
template <typename T>
static inline T nan_max(T a, T b) {
  return (std::isnan(a) || a > b) ? a : b;
}

// Bucket sums of one row of `x` (keys [j0, end)) into pb (R entries).
template <typename T>
static inline void bucket_row(const T* x, const Geometry& g, int64_t p, int64_t j0, int64_t fl,
                              int64_t bd, int64_t end, T* pb) {
  T sum_l = 0, sum_r = 0;
#pragma omp simd reduction(+ : sum_l)
  for (int64_t j = j0; j < fl; ++j) sum_l += x[j - j0];
  T* band = pb + (g.left - p);
  for (int64_t j = fl; j < bd; ++j) band[j] += x[j - j0];
#pragma omp simd reduction(+ : sum_r)
  for (int64_t j = bd; j < end; ++j) sum_r += x[j - j0];
  pb[0] += sum_l;
  pb[g.R - 1] += sum_r;
}

// The largest of x[0..n) (-inf for n = 0; NaN entries are skipped), in 16 independent lanes so
// that the compiler vectorizes it (a plain running max is one long dependency chain).
template <typename T>
static inline T row_max(const T* x, int64_t n) {
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
template <typename T>
static inline T exp_sum(T* x, int64_t n, T offset) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const T e = exp_<T>(x[j] - offset);
    x[j] = e;
    sum += e;
  }
  return sum;
}

// ------------------------------------------------------------------------------------------
// Forward

template <typename T>
static void forward_impl(const Geometry& g, const T* q, const T* k, const T* v, const T* ak,
                         const T* av, const T* kbias, const T* mask, T scale, const Dropout& drop,
                         T* out, T* lse) {
  const int64_t B = g.B, H = g.H, L = g.L, S = g.S, D = g.D, Dv = g.Dv, R = g.R;
  const int64_t BQ = query_block_size(L), BK = key_block_size(L, S);
  const int64_t nqb = (L + BQ - 1) / BQ;
  const T ninf = -std::numeric_limits<T>::infinity();
  const T inv_keep = static_cast<T>(drop.inv_keep);

  at::parallel_for(0, B * H * nqb, 1, [&](int64_t begin, int64_t stop) {
    std::vector<T> sbuf(BQ * BK), qa(ak ? BQ * R : 0), pb(av ? BQ * R : 0), acc(BQ * Dv);
    std::vector<T> m(BQ), l(BQ);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t bh = task / nqb, qb = task % nqb;
      const int64_t b = bh / H, h = bh % H;
      const int64_t i0 = qb * BQ, i1 = std::min(L, i0 + BQ), nq = i1 - i0;
      const T* qp = q + (bh * L + i0) * D;
      const T* kp = k + bh * S * D;
      const T* vp = v + bh * S * Dv;
      const T* akp = ak ? ak + (g.Hr_k == 1 ? 0 : h) * R * D : nullptr;
      const T* avp = av ? av + (g.Hr_v == 1 ? 0 : h) * R * Dv : nullptr;
      const T* kb = kbias ? kbias + b * S : nullptr;
      if (akp) gemm<T>(false, true, nq, R, D, scale, qp, D, akp, D, T(0), qa.data(), R);
      if (avp) std::fill(pb.begin(), pb.begin() + nq * R, T(0));
      std::fill(acc.begin(), acc.begin() + nq * Dv, T(0));
      std::fill(m.begin(), m.end(), ninf);
      std::fill(l.begin(), l.end(), T(0));
      for (int64_t j0 = 0; j0 < S; j0 += BK) {
        if (!g.block_visible(i1, j0)) break;
        const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
        gemm<T>(false, true, nq, nk, D, scale, qp, D, kp + j0 * D, D, T(0), sbuf.data(), nk);
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t i = i0 + r, p = g.query_start + i;
          T* s = sbuf.data() + r * nk;
          int64_t fl, bd, end;
          g.segments(p, j0, j1, fl, bd, end);
          const T* mrow = mask ? mask + b * g.mB + h * g.mH + i * g.mL : nullptr;
          add_masks<T>(s, g, j0, end, kb, mrow);
          const T* qar = akp ? qa.data() + r * R : nullptr;
          const T c0 = qar ? qar[0] : T(0), c1 = qar ? qar[R - 1] : T(0);
          const int64_t nl = fl - j0, nb = bd - fl, nr = end - bd, nv = end - j0;
          T* sb = s + nl;  // the band's scores
          if (qar != nullptr) {
            const T* band = qar + (g.left - p + fl);  // band[x] = QA[i, (fl + x) - p + left]
            for (int64_t x = 0; x < nb; ++x) sb[x] += band[x];
          }
          T mx = ninf;
          if (nl > 0) mx = nan_max<T>(mx, row_max<T>(s, nl) + c0);
          if (nb > 0) mx = nan_max<T>(mx, row_max<T>(sb, nb));
          if (nr > 0) mx = nan_max<T>(mx, row_max<T>(sb + nb, nr) + c1);
          // row_max skips NaN; a row whose visible scores are all NaN must stay NaN, not look
          // empty (other NaNs reach the row through exp and its sum).
          if (mx == ninf) {
            for (int64_t j = 0; j < nv; ++j)
              if (std::isnan(s[j])) mx = std::numeric_limits<T>::quiet_NaN();
          }
          const T m_old = m[r];
          const T m_new = std::isnan(mx) ? mx : std::max(m_old, mx);
          if (m_new == ninf) {  // nothing visible yet in this row
            std::fill(s, s + nk, T(0));
            continue;
          }
          const T alpha = m_old == ninf ? T(0) : exp_<T>(m_old - m_new);
          if (alpha != T(1)) {
            l[r] *= alpha;
            T* a = acc.data() + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
            if (avp) {
              T* pr = pb.data() + r * R;
              for (int64_t x = 0; x < R; ++x) pr[x] *= alpha;
            }
          }
          m[r] = m_new;
          const T sum_l = exp_sum<T>(s, nl, m_new - c0);
          const T sum_b = exp_sum<T>(sb, nb, m_new);
          const T sum_r = exp_sum<T>(sb + nb, nr, m_new - c1);
          for (int64_t j = nv; j < nk; ++j) s[j] = T(0);
          l[r] += sum_l + sum_b + sum_r;
          if (drop.on) {
            uint32_t k1, k2;
            drop.row_keys(bh, i, k1, k2);
            const uint32_t th = drop.threshold;
#pragma omp simd
            for (int64_t j = 0; j < nv; ++j) {
              const bool kp_ = Dropout::keep(static_cast<uint32_t>(j0 + j), k1, k2, th);
              s[j] = kp_ ? s[j] * inv_keep : T(0);
            }
            if (avp) bucket_row<T>(s, g, p, j0, fl, bd, end, pb.data() + r * R);
          } else if (avp) {
            T* pr = pb.data() + r * R;
            pr[0] += sum_l;
            pr[R - 1] += sum_r;
            T* band = pr + (g.left - p + fl);
            for (int64_t x = 0; x < nb; ++x) band[x] += sb[x];
          }
        }
        gemm<T>(false, false, nq, Dv, nk, T(1), sbuf.data(), nk, vp + j0 * Dv, Dv, T(1),
                acc.data(), Dv);
      }
      if (avp) gemm<T>(false, false, nq, Dv, R, T(1), pb.data(), R, avp, Dv, T(1), acc.data(), Dv);
      T* op = out + (bh * L + i0) * Dv;
      T* lp = lse + bh * L + i0;
      for (int64_t r = 0; r < nq; ++r) {
        const T lr = l[r];
        T* o = op + r * Dv;
        const T* a = acc.data() + r * Dv;
        if (lr > T(0) || std::isnan(lr) || std::isnan(m[r])) {
          const T inv = T(1) / lr;
          for (int64_t d = 0; d < Dv; ++d) o[d] = a[d] * inv;
          lp[r] = m[r] + std::log(lr);
        } else {  // a row that sees no key: zeros, and +inf so the backward's P is 0
          for (int64_t d = 0; d < Dv; ++d) o[d] = T(0);
          lp[r] = std::numeric_limits<T>::infinity();
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------
// Backward

template <typename T>
static void backward_impl(const Geometry& g, const T* dout, const T* q, const T* k, const T* v,
                          const T* ak, const T* av, const T* kbias, const T* mask, const T* out,
                          const T* lse,
                          T scale, const Dropout& drop, T* dq, T* dk, T* dv, T* dak_part,
                          T* dav_part) {
  const int64_t B = g.B, H = g.H, L = g.L, S = g.S, D = g.D, Dv = g.Dv, R = g.R;
  const int64_t BQ = query_block_size(L), BK = key_block_size(L, S);
  const T inv_keep = static_cast<T>(drop.inv_keep);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t stop) {
    std::vector<T> sbuf(BQ * BK), dpbuf(BQ * BK), pdbuf(drop.on ? BQ * BK : 0);
    std::vector<T> qa(ak ? BQ * R : 0), doa(av ? BQ * R : 0), pb(av ? BQ * R : 0);
    std::vector<T> dsb(ak ? BQ * R : 0), dqacc(BQ * D), delta(BQ);
    for (int64_t bh = begin; bh < stop; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const T* kp = k + bh * S * D;
      const T* vp = v + bh * S * Dv;
      T* dkp = dk + bh * S * D;
      T* dvp = dv + bh * S * Dv;
      std::fill(dkp, dkp + S * D, T(0));
      std::fill(dvp, dvp + S * Dv, T(0));
      const T* akp = ak ? ak + (g.Hr_k == 1 ? 0 : h) * R * D : nullptr;
      const T* avp = av ? av + (g.Hr_v == 1 ? 0 : h) * R * Dv : nullptr;
      T* dakp = ak ? dak_part + bh * R * D : nullptr;
      T* davp = av ? dav_part + bh * R * Dv : nullptr;
      if (dakp) std::fill(dakp, dakp + R * D, T(0));
      if (davp) std::fill(davp, davp + R * Dv, T(0));
      const T* kb = kbias ? kbias + b * S : nullptr;
      for (int64_t i0 = 0; i0 < L; i0 += BQ) {
        const int64_t i1 = std::min(L, i0 + BQ), nq = i1 - i0;
        const T* qp = q + (bh * L + i0) * D;
        const T* dop = dout + (bh * L + i0) * Dv;
        const T* op = out + (bh * L + i0) * Dv;
        const T* lp = lse + bh * L + i0;
        for (int64_t r = 0; r < nq; ++r) {
          T acc = 0;
          for (int64_t d = 0; d < Dv; ++d) acc += dop[r * Dv + d] * op[r * Dv + d];
          delta[r] = acc;
        }
        if (akp) {
          gemm<T>(false, true, nq, R, D, scale, qp, D, akp, D, T(0), qa.data(), R);
          std::fill(dsb.begin(), dsb.begin() + nq * R, T(0));
        }
        if (avp) {
          gemm<T>(false, true, nq, R, Dv, T(1), dop, Dv, avp, Dv, T(0), doa.data(), R);
          std::fill(pb.begin(), pb.begin() + nq * R, T(0));
        }
        std::fill(dqacc.begin(), dqacc.begin() + nq * D, T(0));
        for (int64_t j0 = 0; j0 < S; j0 += BK) {
          if (!g.block_visible(i1, j0)) break;
          const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
          gemm<T>(false, true, nq, nk, D, scale, qp, D, kp + j0 * D, D, T(0), sbuf.data(), nk);
          gemm<T>(false, true, nq, nk, Dv, T(1), dop, Dv, vp + j0 * Dv, Dv, T(0), dpbuf.data(),
                  nk);
          T* pd = drop.on ? pdbuf.data() : sbuf.data();
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t i = i0 + r, p = g.query_start + i;
            T* s = sbuf.data() + r * nk;
            T* dp = dpbuf.data() + r * nk;
            T* pdr = pd + r * nk;
            int64_t fl, bd, end;
            g.segments(p, j0, j1, fl, bd, end);
            const T* mrow = mask ? mask + b * g.mB + h * g.mH + i * g.mL : nullptr;
            add_masks<T>(s, g, j0, end, kb, mrow);
            const T* qar = akp ? qa.data() + r * R : nullptr;
            const T* doar = avp ? doa.data() + r * R : nullptr;
            const T c0 = qar ? qar[0] : T(0), c1 = qar ? qar[R - 1] : T(0);
            const T e0 = doar ? doar[0] : T(0), e1 = doar ? doar[R - 1] : T(0);
            const int64_t nl = fl - j0, nb = bd - fl, nr = end - bd, nv = end - j0;
            T* sb = s + nl;
            T* dpb = dp + nl;
            if (qar != nullptr) {
              const T* band = qar + (g.left - p + fl);
              for (int64_t x = 0; x < nb; ++x) sb[x] += band[x];
            }
            const T lr = lp[r], dl = delta[r];
            // P, segment by segment (the far constants folded into the offsets)
            const T p_l = exp_sum<T>(s, nl, lr - c0);
            exp_sum<T>(sb, nb, lr);
            const T p_r = exp_sum<T>(sb + nb, nr, lr - c1);
            if (!drop.on) {
              // dS = P (dO . (v_j + aV[r]) - delta): the far segments' dO . aV is a constant
              T ds_l = 0, ds_r = 0;
              const T dl_l = dl - e0, dl_r = dl - e1;
#pragma omp simd reduction(+ : ds_l)
              for (int64_t j = 0; j < nl; ++j) {
                const T x = s[j] * (dp[j] - dl_l);
                dp[j] = x;
                ds_l += x;
              }
              const T* doab = doar ? doar + (g.left - p + fl) : nullptr;
              for (int64_t x = 0; x < nb; ++x)
                dpb[x] = sb[x] * (dpb[x] + (doab ? doab[x] : T(0)) - dl);
              T* dpr = dpb + nb;
              const T* sr = sb + nb;
#pragma omp simd reduction(+ : ds_r)
              for (int64_t j = 0; j < nr; ++j) {
                const T x = sr[j] * (dpr[j] - dl_r);
                dpr[j] = x;
                ds_r += x;
              }
              if (avp) {
                T* pr = pb.data() + r * R;
                pr[0] += p_l;
                pr[R - 1] += p_r;
                T* band = pr + (g.left - p + fl);
                for (int64_t x = 0; x < nb; ++x) band[x] += sb[x];
              }
              if (akp) {
                T* dr = dsb.data() + r * R;
                dr[0] += ds_l;
                dr[R - 1] += ds_r;
                T* band = dr + (g.left - p + fl);
                for (int64_t x = 0; x < nb; ++x) band[x] += dpb[x];
              }
            } else {
              if (doar != nullptr) {
                for (int64_t j = 0; j < nl; ++j) dp[j] += e0;
                const T* doab = doar + (g.left - p + fl);
                for (int64_t x = 0; x < nb; ++x) dpb[x] += doab[x];
                for (int64_t j = 0; j < nr; ++j) dpb[nb + j] += e1;
              }
              uint32_t k1, k2;
              drop.row_keys(bh, i, k1, k2);
              const uint32_t th = drop.threshold;
#pragma omp simd
              for (int64_t j = 0; j < nv; ++j) {
                const T w = Dropout::keep(static_cast<uint32_t>(j0 + j), k1, k2, th) ? inv_keep
                                                                                     : T(0);
                pdr[j] = s[j] * w;
                dp[j] = s[j] * (dp[j] * w - dl);  // dS
              }
              for (int64_t j = nv; j < nk; ++j) pdr[j] = T(0);
              if (avp) bucket_row<T>(pdr, g, p, j0, fl, bd, end, pb.data() + r * R);
              if (akp) bucket_row<T>(dp, g, p, j0, fl, bd, end, dsb.data() + r * R);
            }
            // the masked tail is 0 in both buffers
            for (int64_t j = nv; j < nk; ++j) {
              dp[j] = T(0);
              s[j] = T(0);
            }
          }
          // dv += P^T @ dO, dq += dS @ K, dk += scale * dS^T @ Q
          gemm<T>(true, false, nk, Dv, nq, T(1), pd, nk, dop, Dv, T(1), dvp + j0 * Dv, Dv);
          gemm<T>(false, false, nq, D, nk, T(1), dpbuf.data(), nk, kp + j0 * D, D, T(1),
                  dqacc.data(), D);
          gemm<T>(true, false, nk, D, nq, scale, dpbuf.data(), nk, qp, D, T(1), dkp + j0 * D, D);
        }
        if (akp) {
          gemm<T>(false, false, nq, D, R, T(1), dsb.data(), R, akp, D, T(1), dqacc.data(), D);
          gemm<T>(true, false, R, D, nq, scale, dsb.data(), R, qp, D, T(1), dakp, D);
        }
        if (avp) gemm<T>(true, false, R, Dv, nq, T(1), pb.data(), R, dop, Dv, T(1), davp, Dv);
        T* dqp = dq + (bh * L + i0) * D;
        for (int64_t x = 0; x < nq * D; ++x) dqp[x] = scale * dqacc[x];
      }
    }
  });
}

// ------------------------------------------------------------------------------------------
// Entry points

static Geometry geometry(const Tensor& q, const Tensor& k, const Tensor& v,
                         const c10::optional<Tensor>& ak, const c10::optional<Tensor>& av,
                         const c10::optional<Tensor>& mask, int64_t left, int64_t right,
                         bool causal, int64_t query_start) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "query, key, value must be 4-D");
  Geometry g;
  g.B = q.size(0);
  g.H = q.size(1);
  g.L = q.size(2);
  g.D = q.size(3);
  g.S = k.size(2);
  g.Dv = v.size(3);
  g.left = left;
  g.right = right;
  g.R = left + right + 1;
  g.causal = causal;
  g.query_start = query_start;
  g.Hr_k = ak.has_value() ? ak->size(0) : 1;
  g.Hr_v = av.has_value() ? av->size(0) : 1;
  TORCH_CHECK(g.R * std::max(g.D, g.Dv) < (int64_t(1) << 31), "table too large");
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(0) == g.B && mask->size(1) == g.H &&
                    mask->size(2) == g.L && mask->size(3) == g.S,
                "attn_bias must be expanded to (B, H, L, S)");
    TORCH_CHECK(mask->scalar_type() == q.scalar_type(), "attn_bias must have the query's dtype");
    g.mB = mask->stride(0);
    g.mH = mask->stride(1);
    g.mL = mask->stride(2);
    g.mS = mask->stride(3);
  }
  return g;
}

template <typename T>
static const T* ptr_or_null(const c10::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

static c10::optional<Tensor> contig(const c10::optional<Tensor>& t) {
  if (!t.has_value()) return c10::nullopt;
  return t->contiguous();
}

std::vector<Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                            const c10::optional<Tensor>& rel_keys,
                            const c10::optional<Tensor>& rel_values,
                            const c10::optional<Tensor>& key_bias,
                            const c10::optional<Tensor>& attn_bias, int64_t left, int64_t right,
                            bool is_causal, double scale, int64_t query_start, double dropout_p,
                            const c10::optional<Tensor>& seed) {
  auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values), kb = contig(key_bias);
  Geometry g = geometry(q, k, v, ak, av, attn_bias, left, right, is_causal, query_start);
  auto out = at::empty({g.B, g.H, g.L, g.Dv}, q.options());
  auto lse = at::empty({g.B, g.H, g.L}, q.options());
  Dropout drop(dropout_p, seed, g.L);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward", [&] {
    forward_impl<scalar_t>(g, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                           v.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(ak),
                           ptr_or_null<scalar_t>(av), ptr_or_null<scalar_t>(kb),
                           ptr_or_null<scalar_t>(attn_bias), static_cast<scalar_t>(scale), drop,
                           out.data_ptr<scalar_t>(),
                           lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

std::vector<Tensor> backward(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                             const Tensor& value, const c10::optional<Tensor>& rel_keys,
                             const c10::optional<Tensor>& rel_values,
                             const c10::optional<Tensor>& key_bias,
                             const c10::optional<Tensor>& attn_bias, const Tensor& out,
                             const Tensor& lse, int64_t left, int64_t right, bool is_causal,
                             double scale, int64_t query_start, double dropout_p,
                             const c10::optional<Tensor>& seed) {
  auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  auto go = grad_out.contiguous(), o = out.contiguous(), ls = lse.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values), kb = contig(key_bias);
  Geometry g = geometry(q, k, v, ak, av, attn_bias, left, right, is_causal, query_start);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  Tensor dak_part, dav_part, dak, dav;
  if (ak) dak_part = at::empty({g.B, g.H, g.R, g.D}, q.options());
  if (av) dav_part = at::empty({g.B, g.H, g.R, g.Dv}, q.options());
  Dropout drop(dropout_p, seed, g.L);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward", [&] {
    backward_impl<scalar_t>(g, go.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                            k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            ptr_or_null<scalar_t>(ak), ptr_or_null<scalar_t>(av),
                            ptr_or_null<scalar_t>(kb), ptr_or_null<scalar_t>(attn_bias),
                            o.data_ptr<scalar_t>(),
                            ls.data_ptr<scalar_t>(), static_cast<scalar_t>(scale), drop,
                            dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                            dv.data_ptr<scalar_t>(),
                            ak ? dak_part.data_ptr<scalar_t>() : nullptr,
                            av ? dav_part.data_ptr<scalar_t>() : nullptr);
    // Fixed-order reduction of the per-(batch, head) partials.
    auto reduce = [&](const Tensor& part, int64_t Hr, int64_t width) {
      auto res = at::zeros({Hr, g.R, width}, q.options());
      const scalar_t* src = part.data_ptr<scalar_t>();
      scalar_t* dst = res.data_ptr<scalar_t>();
      const int64_t n = g.R * width;
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t h = 0; h < g.H; ++h) {
          scalar_t* d = dst + (Hr == 1 ? 0 : h) * n;
          const scalar_t* s = src + (b * g.H + h) * n;
          for (int64_t x = 0; x < n; ++x) d[x] += s[x];
        }
      return res;
    };
    if (ak) dak = reduce(dak_part, g.Hr_k, g.D);
    if (av) dav = reduce(dav_part, g.Hr_v, g.Dv);
  });
  return {dq, dk, dv, ak ? dak : at::empty({0}, q.options()),
          av ? dav : at::empty({0}, q.options())};
}

Tensor dropout_mask(const Tensor& seed, int64_t B, int64_t H, int64_t L, int64_t S,
                    double dropout_p) {
  Dropout drop(dropout_p, seed, L);
  auto mask = at::empty({B, H, L, S}, at::TensorOptions().dtype(at::kBool));
  bool* mp = mask.data_ptr<bool>();
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < L; ++i) {
      uint32_t k1 = 0, k2 = 0;
      if (drop.on) drop.row_keys(bh, i, k1, k2);
      bool* row = mp + (bh * L + i) * S;
      for (int64_t j = 0; j < S; ++j)
        row[j] = !drop.on ||
                 Dropout::keep(static_cast<uint32_t>(j), k1, k2, drop.threshold);
    }
  return mask;
}

std::string build_info() {
#ifdef RELPOS_HAVE_BLAS
  return "blas=mkl";
#else
  return "blas=fallback";
#endif
}

}  // namespace relpos_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &relpos_native::forward, "relpos native forward");
  m.def("backward", &relpos_native::backward, "relpos native backward");
  m.def("dropout_mask", &relpos_native::dropout_mask, "the keep mask of a dropout seed");
  m.def("build_info", &relpos_native::build_info, "how the kernels were built");
}
