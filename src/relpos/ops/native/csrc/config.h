// What every file of the native kernels builds on: the standard headers, the instruction-set
// intrinsics and OS calls they use, RELPOS_INLINE, and the instruction-set flags that decide
// what a build compiles (from the compiler's -march: this CPU for a native build, a portable
// variant's for a prebuilt one, relpos.ops.native.variants):
//
//   RELPOS_VEC_FLOAT        float32 row passes and GEMMs on explicit vectors: AVX-512, or AVX2
//                           with FMA (vec.h, gemm_vec.h)
//   RELPOS_HAVE_BF16_TILES  bfloat16 GEMMs on packed tiles by VDPBF16PS: AVX512-BF16
//                           (gemm_tiles.h)
//   RELPOS_HAVE_AMX         ... and on AMX tiles: AMX-BF16, on Linux (gemm_tiles.h)
//   RELPOS_HAVE_BLAS        set by the build (relpos.ops.native.target) where libtorch exports
//                           the BLAS's sgemm_ and dgemm_ (gemm_blas.h)
//
// No torch here: vec.h and gemm_vec.h, which need nothing else, compile alone in the tests.

#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define RELPOS_VEC_FLOAT 1
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RELPOS_HAVE_BF16_TILES 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define RELPOS_HAVE_AMX 1
#endif
#endif
