// The kernels' float arithmetic below the GEMMs: exp (exp_float, exact std::exp for double), the
// explicit float vectors (VecF: AVX-512 or AVX2 + FMA) and the row passes on them (max, exp and
// sum, far-segment dS, add), the 16 x 16 transpose of 32-bit lanes (AVX-512: the tile packers'
// and the vector GEMMs'), and a row of P rounded to bfloat16 by the softmax itself. No torch:
// tests/ops/test_native_vectors.py and tests/ops/test_exp.py compile it alone.

#pragma once

#include "config.h"

namespace relpos_native {

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
// Explicit vectors for float's row passes (max, exp and sum, dS of far segments): AVX-512 where
// the build's ISA has it (16 lanes, masked tails), AVX2 + FMA otherwise (8 lanes, tails through
// maskload / maskstore), row_phases.h's scalar loops on any other ISA and for double. A
// segment's tail is one masked vector operation, not a scalar loop. The arithmetic is
// exp_float's, lane by lane (the same reduction and polynomial), so vector and scalar rows agree
// to rounding.

#if defined(__AVX512F__)
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
  static RELPOS_INLINE V clamp(V x, V lo, V hi) { return _mm512_min_ps(hi, _mm512_max_ps(lo, x)); }
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
  static RELPOS_INLINE V clamp(V x, V lo, V hi) { return _mm256_min_ps(hi, _mm256_max_ps(lo, x)); }
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
    for (const float c :
         {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
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
    const VecF::V x =
        VecF::mul(VecF::load_tail(p + j, m, zero), VecF::sub(VecF::load_tail(dp + j, m, zero), cv));
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
    VecF::store_tail(
        dst + j, m,
        VecF::add(VecF::load_tail(dst + j, m, zero), VecF::load_tail(src + j, m, zero)));
  }
}
#endif  // RELPOS_VEC_FLOAT

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

}  // namespace relpos_native
