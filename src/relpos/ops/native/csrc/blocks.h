// Block sizes: the query rows of a forward and a backward block, the keys of a tile, and why.

#pragma once

#include "config.h"

namespace relpos_native {

// Measured against SDPA (forward, and forward + backward; one and two threads; B x n from 64 x
// 64 to 1 x 4096; the report was not kept, these lines are its record): the forward runs faster
// with taller query blocks (each K/V tile and the table GEMMs serve more rows, MKL packs K_J^T
// once per 256 rows instead of per 64: 1 x 4096 went from 1.12x to 1.0x SDPA with the tables),
// so a forward block is 256 rows, halved (down to 64) while the call would have fewer than
// kForwardTasks tasks, so that a call with few heads still spreads over the threads; the rule
// reads the shapes only, so the blocks (and the bits) are the same at every thread count. The
// backward holds two tiles (dP beside S) and runs best at 128 rows. The key block is torch's
// CPU flash kernel's 512: a 256 x 512 tile is 512 KiB of float scores.

constexpr int64_t kForwardQueryBlock = 256;    // rows of Q per forward block, at most
constexpr int64_t kMinForwardQueryBlock = 64;  // ... and at least (unless L is shorter)
constexpr int64_t kForwardTasks = 64;          // halve the block while fewer tasks than this
constexpr int64_t kBackwardQueryBlock = 128;   // rows of Q per backward block
constexpr int64_t kKeyBlock = 512;             // keys per tile
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
    return std::min<int64_t>(S,
                             std::max<int64_t>(kKeyBlock, kDecodeScores / std::max<int64_t>(L, 1)));
  return std::min<int64_t>(S, kKeyBlock);
}

}  // namespace relpos_native
