// dst[j] = src[j] in another floating type: any two by a scalar loop, float16 <-> float by the
// CPU's conversion instructions (F16C, AVX-512). 16-bit inputs widened per tile, P and dS rounded
// for the 16-bit GEMMs, outputs rounded once.

#pragma once

#include "config.h"

#include <c10/util/Half.h>

namespace relpos_native {

// dst[j] = src[j] in another floating type (rounded to nearest even where it narrows).
template <typename From, typename To>
static inline void convert(const From* src, To* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<To>(static_cast<float>(src[j]));
}

// float16 <-> float by the CPU's conversion instructions (vcvtph2ps / vcvtps2ph: 16 lanes with
// AVX-512, 8 with F16C), rounding to nearest even as c10::Half does; the overloads win over
// convert<From, To> for these types. (bfloat16's conversions are shifts the compiler
// vectorizes.)
#if defined(__AVX512F__) || defined(__F16C__)
static inline void convert(const c10::Half* src, float* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(
        dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))));
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
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(dst + j),
        _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(dst + j),
        _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; j < n; ++j) dst[j] = static_cast<c10::Half>(src[j]);
}
#endif

}  // namespace relpos_native
