// Dropout: a counter-based hash (two rounds of murmur3's finalizer per element, a 64-bit mix
// per row), so forward, backward and `dropout_mask` produce the same keep mask. Row numbers:
// (b * H + h) * L + i for query i of head (b, h) of a padded call, h * Tq + cu_q[s] + i for
// query i of sequence s of a varlen call (Tq: all the call's queries); the key index j is the
// key's within its batch row or sequence.

#pragma once

#include "config.h"

#include <torch/extension.h>

namespace relpos_native {

using at::Tensor;

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
                    "a dropout placement needs rows per head, row offset and key offset >= 0, ",
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
    const uint64_t z =
        mix64(seed0 ^ mix64(seed1 + static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ULL));
    k1 = static_cast<uint32_t>(z);
    k2 = static_cast<uint32_t>(z >> 32);
  }

  static inline bool keep(uint32_t j, uint32_t k1, uint32_t k2, uint32_t threshold) {
    uint32_t h = fmix32((j * 0x9E3779B1u) ^ k1);
    h = fmix32(h + k2);
    return h >= threshold;
  }
};

}  // namespace relpos_native
