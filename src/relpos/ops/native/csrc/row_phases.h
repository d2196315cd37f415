// The passes over one row of a tile that both directions make: the row primitives (max, exp and
// sum, add; the float vectors where the build has them) and the phases of a row (the far
// segments' constants, masks, the band's key term, exp by segment, bucket sums). Each is forced
// inline into the row of forward.h or backward.h that calls it.

#pragma once

#include "config.h"
#include "geometry.h"
#include "vec.h"

namespace relpos_native {

// ------------------------------------------------------------------------------------------
// Row primitives

// max(a, b), NaN if either is.
template <typename accum_t>
static inline accum_t nan_max(accum_t a, accum_t b) {
  return (std::isnan(a) || a > b) ? a : b;
}

// The largest of x[0..n) (-inf for n = 0; NaN entries are skipped), in 16 independent lanes so
// that the compiler vectorizes it (a plain running max is one long dependency chain).
template <typename accum_t>
static inline accum_t row_max(const accum_t* x, int64_t n) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<accum_t, float>) return row_max_vec(x, n);
#endif
  constexpr int W = 16;
  accum_t lane[W];
  for (int u = 0; u < W; ++u) lane[u] = -std::numeric_limits<accum_t>::infinity();
  int64_t j = 0;
  for (; j + W <= n; j += W)
    for (int u = 0; u < W; ++u) lane[u] = x[j + u] > lane[u] ? x[j + u] : lane[u];
  accum_t mx = -std::numeric_limits<accum_t>::infinity();
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  for (int u = 0; u < W; ++u) mx = lane[u] > mx ? lane[u] : mx;
  return mx;
}

// dst[j] += src[j] over n entries.
template <typename accum_t>
static inline void add_to(accum_t* dst, const accum_t* src, int64_t n) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<accum_t, float>) return add_to_vec(dst, src, n);
#endif
  for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
}

// x[j] = exp(x[j] - offset) over n entries; returns their sum. Low: the vector path may take
// the cheaper polynomial (vec_exp; 16-bit calls only). Acc: acc[j] += x[j] too.
template <typename accum_t, bool Low = false, bool Acc = false>
static inline accum_t exp_sum(accum_t* x, int64_t n, accum_t offset, accum_t* acc = nullptr) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<accum_t, float>) return exp_sum_vec<Low, Acc>(x, n, offset, acc);
#endif
  accum_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const accum_t e = exp_<accum_t>(x[j] - offset);
    x[j] = e;
    if constexpr (Acc) acc[j] += e;
    sum += e;
  }
  return sum;
}

// x[j] = exp(x[j] + far - offset) over a far segment, whose relative term is the one constant
// `far`; returns their sum. A hidden key (-inf) gives 0 even where the constant is not finite
// (-inf + inf, -inf + NaN): a non-finite table row reaches no row through keys it does not see.
template <typename accum_t, bool Low = false>
static inline accum_t far_exp_sum(accum_t* x, int64_t n, accum_t offset, accum_t far) {
  if (std::isfinite(far)) return exp_sum<accum_t, Low>(x, n, offset - far);
  const accum_t ninf = -std::numeric_limits<accum_t>::infinity();
  accum_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const accum_t e = x[j] == ninf ? accum_t(0) : exp_<accum_t>(x[j] - (offset - far));
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
template <typename accum_t>
struct FarConstants {
  accum_t left, right;
};

template <typename accum_t>
static inline FarConstants<accum_t> far_constants(const accum_t* table_row, int64_t R) {
  return {table_row ? table_row[0] : accum_t(0), table_row ? table_row[R - 1] : accum_t(0)};
}

// Tile masks: the key bias and the row of a dense mask, added to the visible keys [j0, end)
// (-inf hides a key whatever its score, band key term included: added after it).
template <typename accum_t>
static inline void add_masks(accum_t* s, const Geometry& g, int64_t j0, int64_t end,
                             const accum_t* kb, const accum_t* mrow) {
  const accum_t ninf = -std::numeric_limits<accum_t>::infinity();
  if (kb != nullptr) {
#pragma omp simd
    for (int64_t j = j0; j < end; ++j) {
      const accum_t b = kb[j];
      s[j - j0] = b == ninf ? ninf : s[j - j0] + b;
    }
  }
  if (mrow != nullptr) {  // row of a dense mask: mrow[j * mS]
    const int64_t st = g.mS;
    for (int64_t j = j0; j < end; ++j) {
      const accum_t b = mrow[j * st];
      s[j - j0] = b == ninf ? ninf : s[j - j0] + b;
    }
  }
}

// Band key term: s_ij += QA[i, j - p + left] for the band's keys, before the masks (so that a
// hidden key is -inf even where its table row is not finite). The far segments' constants
// QA[i, 0] and QA[i, R-1] are not added here: they are folded into the max and the exp offset,
// so far keys cost no extra pass (hidden far keys then stay out: far_segment_max, far_exp_sum).
template <typename accum_t>
static RELPOS_INLINE void add_band_key_term(accum_t* s, const RowSegments& seg,
                                            const accum_t* qa_row) {
  if (qa_row == nullptr) return;
  accum_t* band_scores = s + seg.n_left;
  const accum_t* band = qa_row + seg.band_row;  // band[x] = QA[i, (fl + x) - p + left]
  add_to<accum_t>(band_scores, band, seg.n_band);
}

template <typename accum_t>
struct SegmentSums {
  accum_t left, band, right;
};

// s = exp(s + far constant - offset), segment by segment; returns each segment's sum. Low:
// a call with 16-bit inputs (exp_sum). With buckets (R entries), the row's bucket masses are
// added in the same pass (add_to_buckets's; the band's table rows are 1 .. R-2).
template <typename accum_t, bool Low = false>
static RELPOS_INLINE SegmentSums<accum_t> exp_segments(accum_t* s, const RowSegments& seg,
                                                       FarConstants<accum_t> qa_far, accum_t offset,
                                                       accum_t* buckets = nullptr, int64_t R = 0) {
  accum_t* band_scores = s + seg.n_left;
  SegmentSums<accum_t> sum;
  sum.left = far_exp_sum<accum_t, Low>(s, seg.n_left, offset, qa_far.left);
  if (buckets != nullptr)
    sum.band = exp_sum<accum_t, Low, true>(band_scores, seg.n_band, offset, buckets + seg.band_row);
  else
    sum.band = exp_sum<accum_t, Low>(band_scores, seg.n_band, offset);
  sum.right =
      far_exp_sum<accum_t, Low>(band_scores + seg.n_band, seg.n_right, offset, qa_far.right);
  if (buckets != nullptr) {
    buckets[0] += sum.left;
    buckets[R - 1] += sum.right;
  }
  return sum;
}

// Bucket update: adds a row's bucket sums to its R table rows, the far segments' (known) sums to
// rows 0 and R-1, the band entry by entry.
template <typename accum_t>
static RELPOS_INLINE void add_to_buckets(accum_t* buckets, int64_t R, const RowSegments& seg,
                                         accum_t far_left_sum, const accum_t* band,
                                         accum_t far_right_sum) {
  buckets[0] += far_left_sum;
  buckets[R - 1] += far_right_sum;
  add_to<accum_t>(buckets + seg.band_row, band, seg.n_band);
}

// Bucket update of a row whose far sums are not known (after dropout): sums them first.
template <typename accum_t>
static RELPOS_INLINE void bucket_row(const accum_t* x, int64_t R, const RowSegments& seg,
                                     accum_t* buckets) {
  accum_t sum_l = 0, sum_r = 0;
#pragma omp simd reduction(+ : sum_l)
  for (int64_t j = 0; j < seg.n_left; ++j) sum_l += x[j];
  const accum_t* right = x + seg.n_left + seg.n_band;
#pragma omp simd reduction(+ : sum_r)
  for (int64_t j = 0; j < seg.n_right; ++j) sum_r += right[j];
  add_to_buckets(buckets, R, seg, sum_l, x + seg.n_left, sum_r);
}

}  // namespace relpos_native
