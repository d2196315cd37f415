// From a call's tensors to what the kernels take, with every check that keeps the kernels inside
// the tensors: the window (set_window), the tables' shapes, the dtypes, a padded call's Geometry
// and Inputs (16-bit calls: the tables and masks as float, and the tables in the 16-bit type
// for the 16-bit GEMMs), and a varlen call's cumulative lengths, seqused_k, Packing and
// VarlenCall.

#pragma once

#include "attention.h"
#include "blocks.h"
#include "config.h"
#include "gemm.h"
#include "geometry.h"

#include <torch/extension.h>

namespace relpos_native {

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
  TORCH_CHECK(g.L <= kMaxPosition && g.S <= kMaxPosition && options.query_start >= -kMaxPosition &&
                  options.query_start <= kMaxPosition,
              "query_start=", options.query_start, " is out of range");
  const c10::optional<Tensor>& table = ak.has_value() ? ak : av;
  if (table.has_value()) {
    for (const c10::optional<Tensor>* t : {&ak, &av})
      TORCH_CHECK(!t->has_value() || (*t)->dim() == 3, "tables must be 3-D (Hr, R, D)");
    const int64_t rows = table->size(1);
    TORCH_CHECK(left < rows && right == rows - 1 - left &&
                    (!ak.has_value() || !av.has_value() || av->size(1) == rows),
                "the window (left=", left, ", right=", right,
                ") needs left + right + 1 table rows, got ", rows);
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
                "tables must be (1 or H, R, D) for rel_keys and (1 or H, R, Dv) for rel_values ",
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
static Inputs<float, I> half_inputs(
    const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& ak,
    const c10::optional<Tensor>& av, const c10::optional<Tensor>& kb,
    const c10::optional<Tensor>& attn_bias, bool low,
    std::pair<c10::optional<Tensor>, c10::optional<Tensor>>& low_tables) {
  Inputs<float, I> in{q.data_ptr<I>(),
                      k.data_ptr<I>(),
                      v.data_ptr<I>(),
                      ptr_or_null<float>(ak),
                      ptr_or_null<float>(av),
                      ptr_or_null<float>(kb),
                      ptr_or_null<float>(attn_bias)};
  if (ak) in.ak_finite = all_finite(in.ak, ak->numel());
  low_tables = tables_in(ak, av, q.scalar_type(), low);
  in.ak_low = ptr_or_null<I>(low_tables.first);
  in.av_low = ptr_or_null<I>(low_tables.second);
  return in;
}

// A 16-bit call's engines for query blocks of BQ rows and its inputs, the tables rounded to I
// (kept in low_tables) where those engines run 16-bit GEMMs.
template <typename I>
static std::pair<HalfGemms, Inputs<float, I>> reduced_call(
    int64_t BQ, const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& ak,
    const c10::optional<Tensor>& av, const c10::optional<Tensor>& kb,
    const c10::optional<Tensor>& attn_bias,
    std::pair<c10::optional<Tensor>, c10::optional<Tensor>>& low_tables) {
  const HalfGemms gemms = for_query_blocks(half_gemms_now<I>(), BQ);
  return {gemms, half_inputs<I>(q, k, v, ak, av, kb, attn_bias, gemms.low, low_tables)};
}

template <typename T>
static Inputs<T> inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                        const c10::optional<Tensor>& ak, const c10::optional<Tensor>& av,
                        const c10::optional<Tensor>& kb, const c10::optional<Tensor>& attn_bias) {
  return {q.data_ptr<T>(),    k.data_ptr<T>(),    v.data_ptr<T>(),          ptr_or_null<T>(ak),
          ptr_or_null<T>(av), ptr_or_null<T>(kb), ptr_or_null<T>(attn_bias)};
}

// ------------------------------------------------------------------------------------------
// Varlen calls

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
    TORCH_CHECK(p[s] >= p[s - 1], name, " must be non-decreasing, got ", p[s - 1], " then ", p[s],
                " at entry ", s);
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
static Packing packing(const Tensor& cu_q, const Tensor& cu_k, int64_t H, int64_t Tq, int64_t Tk) {
  TORCH_CHECK(cu_q.numel() == cu_k.numel(),
              "cu_seqlens_q and cu_seqlens_k must have one length (N + 1), got ", cu_q.numel(),
              " and ", cu_k.numel());
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
static VarlenCall varlen_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                              const Tensor& cu_k, const c10::optional<Tensor>& seqused_k,
                              Tensor& used, const c10::optional<Tensor>& ak,
                              const c10::optional<Tensor>& av, const AttentionOptions& options) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "query, key, value must be 3-D (T, H, D)");
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu(), "the native kernels take CPU tensors, got ", t->device());
  for (const c10::optional<Tensor>* t : {&ak, &av})
    TORCH_CHECK(!t->has_value() || (*t)->device().is_cpu(),
                "the native kernels take CPU tensors, got ", (*t)->device());
  const int64_t H = q.size(1);
  TORCH_CHECK(k.size(1) == H && v.size(1) == H && k.size(2) == q.size(2) && v.size(0) == k.size(0),
              "query (Tq, H, D), key (Tk, H, D) and value (Tk, H, Dv) do not match: ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(options.query_start == 0,
              "a varlen call aligns each sequence bottom-right: query_start must be 0, got ",
              options.query_start);
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

}  // namespace relpos_native
