// A call as the kernels see it: where a row meets a key block (RowSegments), the call's shapes,
// window and mask strides (Geometry), its tensors as raw pointers (Inputs), what one task's
// head reads (Head: head_of for a padded call, varlen_head for a varlen one), and a varlen
// call's packing (Packing, VarlenCall). The scalar options are attention.h's AttentionOptions;
// checks.h builds these from the tensors.

#pragma once

#include "config.h"
#include "dropout.h"

namespace relpos_native {

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
  const I* q;                 // (B, H, L, D)
  const I* k;                 // (B, H, S, D)
  const I* v;                 // (B, H, S, Dv)
  const T* ak;                // (Hr_k, R, D) or nullptr
  const T* av;                // (Hr_v, R, Dv) or nullptr
  const T* key_bias;          // (B, S) or nullptr
  const T* attn_bias;         // (B, H, L, S) in the strides of Geometry::mB.. or nullptr
  bool ak_finite = true;      // (backward) every entry of ak is finite
  const I* ak_low = nullptr;  // 16-bit inputs with 16-bit GEMMs: the tables in I too
  const I* av_low = nullptr;
};

// What one task's head reads: the queries, keys, values, tables (shared or its own) and key
// bias of one (batch, head) or (sequence, head), and the dropout row of its query 0.
template <typename T, typename I = T>
struct Head {
  int64_t b, h;         // batch row (0 for a varlen sequence) and head: where its mask rows are
  int64_t dropout_row;  // query i's dropout row is dropout_row + i
  const I* q;           // (L, D)
  const I* k;           // (S, D)
  const I* v;           // (S, Dv)
  const T* ak;          // (R, D) or nullptr
  const T* av;          // (R, Dv) or nullptr
  const T* key_bias;    // (S) or nullptr
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
static inline Head<T, I> varlen_head(const Geometry& g, const Packing& pk, const Inputs<T, I>& in,
                                     int64_t s, int64_t h) {
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

// A varlen call: its packing, each sequence's geometry, and what one thread's buffers must hold
// for any of them (the largest query block, tile and R).
struct VarlenCall {
  Packing pk;
  std::vector<Geometry> seqs;  // (N)
  int64_t D = 0, Dv = 0, BQ = 1, tile = 0, R = 1;
  int64_t heads = 1;  // N · H: the (sequence, head) pairs, for forward_query_block
  int64_t BK = 1;     // the largest key block
};

}  // namespace relpos_native
