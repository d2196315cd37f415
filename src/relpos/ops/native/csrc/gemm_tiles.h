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
// path rounds them. bf16_gemm() (gemm.h) says which engine (or brgemm, or widened tiles) a
// call runs; the probes it reads are here too (amx_granted, cpu_has_amx_bf16,
// dot_products_pay).

#pragma once

#include "config.h"
#include "vec.h"

namespace relpos_native {

// Where a call's bfloat16 tile GEMMs run: brgemm on unpacked operands (kNoTiles), or on
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

// Whether the CPU has AMX-BF16 (CPUID leaf 7: EDX bit 22), which oneDNN's bfloat16 GEMMs then run
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
// (benchmarks/half_precision_engines_xeon.md); other cores (AMD's Zen 4 and 5 among them, not
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
  alignas(64) static const uint16_t interleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                      21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                      11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(interleave);
  for (int64_t t = 0; t < NT; ++t) {
    const int64_t n0 = t * 16, nn = std::max<int64_t>(0, std::min<int64_t>(16, N - n0));
    const __mmask16 m = nn >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nn) - 1);
    for (int64_t c = 0; c < KB; ++c) {
      uint16_t* tile = out + (t * KB + c) * kTileElems;
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t k = c * 32 + 2 * p;
        const __m256i r0 =
            k < K && nn > 0 ? _mm256_maskz_loadu_epi16(m, b + k * N + n0) : _mm256_setzero_si256();
        const __m256i r1 = k + 1 < K && nn > 0 ? _mm256_maskz_loadu_epi16(m, b + (k + 1) * N + n0)
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

static inline void tile_gemm_scaled(TileGemm engine, int64_t M, int64_t N, int64_t KB, float scale,
                                    const uint16_t* a, const uint16_t* b, float* s) {
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
                                                  int64_t BK, int64_t j0, int64_t nk, int64_t N) {
  const int64_t n = std::min(BK, S - j0);
  if (nk != n) return nullptr;
  return cache.tile(head, S, BK, amx_tiles_of(N) * amx_kblocks(BK) * kTileElems, j0,
                    [&](uint16_t* p) { amx_pack_pairs(bits_of(head + j0 * N), n, N, p); });
}
#endif  // RELPOS_HAVE_BF16_TILES

}  // namespace relpos_native
