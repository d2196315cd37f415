"""The native kernels' packed variable-length op ``relpos::native_attention_varlen`` (flash-
attention's varlen layout): each sequence against ``relpos.relative_attention(...,
implementation="reference")`` in float64, forward and all five gradients, at awkward lengths
(empty sequences, keys without queries and queries without keys, L < S and L > S, several
query blocks), windows, keys-only and values-only, shared and per-head tables, any strides;
dropout with the kernels' own masks; parity with the padded op; the same bits at one and two
threads; opcheck, gradcheck and torch.compile; half precision; the kernel's own checks of bad
input, and empty calls; ``seqused_k`` (each sequence uses the first keys of its key region, the
rest spare capacity): against the reference on the used rows and bitwise the call on the
compacted packing, zero gradients in the spare rows, the kernel's checks of it.

Shape legend: N sequences, Tq and Tk all their queries and keys, H heads, D head dim, Dv value
head dim, R = left + right + 1 table rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import relpos
from helpers import F64
from relpos.ops import native
from relpos.ops.native import op

LEFT, RIGHT = 3, 2  # the window of most tests: offsets clipped to [-3, 2]
K = LEFT
# (L_s, S_s) per sequence: sequences without queries, keys or either; lengths around the
# window; L < S and L > S (causal rows that see no key); a decode-like one (L <= 8, one key
# block); and one of three query blocks.
LENGTHS = [(0, 3), (1, 1), (2, 5), (K - 1, K + 1), (K, K), (K + 1, K - 1), (3, 0), (0, 0),
           (150, 140), (7, 2), (40, 150), (K + 1, K), (5, 600)]
SMALL = [(0, 3), (1, 1), (2, 5), (K - 1, K + 1), (K + 1, K - 1), (3, 0), (9, 7), (6, 12)]
TABLES = {  # (rel_keys, rel_values): "shared" (1, R, ·), "per_head" (H, R, ·) or absent
    "both_shared": ("shared", "shared"),
    "both_per_head": ("per_head", "per_head"),
    "keys_only": ("shared", None),
    "values_only": (None, "per_head"),
    "mixed": ("per_head", "shared"),
    "none": (None, None),
}


@dataclass
class Packed:
    """A packed batch: float64 leaves, the cumulative lengths and, for a call with spare key
    capacity, the keys each sequence uses (``seqused_k``)."""

    query: Tensor  # (Tq, H, D)
    key: Tensor  # (Tk, H, D)
    value: Tensor  # (Tk, H, Dv)
    rel_keys: Tensor | None  # (Hr, R, D)
    rel_values: Tensor | None  # (Hr, R, Dv)
    cu_q: Tensor  # (N + 1,)
    cu_k: Tensor  # (N + 1,): the key regions
    used_k: Tensor | None = None  # (N,): the first rows of each region in use, or all

    def leaves(self) -> list[Tensor]:
        return [t for t in (self.query, self.key, self.value, self.rel_keys, self.rel_values)
                if t is not None]

    def sequences(self) -> Iterator[tuple[slice, slice]]:
        """Each sequence's query rows and the key rows it uses."""
        cq, ck = self.cu_q.tolist(), self.cu_k.tolist()
        used = None if self.used_k is None else self.used_k.tolist()
        for s in range(len(cq) - 1):
            end = ck[s + 1] if used is None else ck[s] + used[s]
            yield slice(cq[s], cq[s + 1]), slice(ck[s], end)

    def spare_rows(self) -> Tensor:
        """(Tk,) bool: the key rows past each sequence's used keys."""
        spare = torch.ones(self.key.shape[0], dtype=torch.bool)
        for _, ks in self.sequences():
            spare[ks] = False
        return spare


def make_packed(lengths: list[tuple[int, int]], *, H: int = 2, D: int = 5, Dv: int = 3,
                tables: tuple[str | None, str | None] = ("shared", "shared"),
                R: int = LEFT + RIGHT + 1, seed: int = 0, dtype: torch.dtype = F64,
                spare: list[int] | None = None, spare_value: float | None = math.nan
                ) -> Packed:
    """With ``spare`` (one count per sequence), sequence s's key region is its S_s keys and
    then ``spare[s]`` rows it does not use (``seqused_k = S_s``), holding ``spare_value``
    (NaN: any read of them shows; None: random like the rest)."""
    g = torch.Generator().manual_seed(seed)

    def tensor(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    def table(kind: str | None, width: int) -> Tensor | None:
        return (None if kind is None else
                tensor(H if kind == "per_head" else 1, R, width).requires_grad_(True))

    extra = [0] * len(lengths) if spare is None else spare
    regions = [S + n for (_, S), n in zip(lengths, extra, strict=True)]
    Tq, Tk = sum(L for L, _ in lengths), sum(regions)
    cu = [torch.tensor([0, *n], dtype=torch.int64).cumsum(0)
          for n in ([L for L, _ in lengths], regions)]
    q, k, v = tensor(Tq, H, D), tensor(Tk, H, D), tensor(Tk, H, Dv)
    used = None if spare is None else torch.tensor([S for _, S in lengths], dtype=torch.int64)
    p = Packed(q, k, v, table(tables[0], D), table(tables[1], Dv), cu[0], cu[1], used)
    if spare is not None and spare_value is not None:
        rows = p.spare_rows()
        k[rows], v[rows] = spare_value, spare_value
    for t in (q, k, v):
        t.requires_grad_(True)
    return p


# The layouts the op is handed its inputs in, each a differentiable view of the leaves.
LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "contiguous": lambda t: t,
    "strided": lambda t: F.pad(t, (1, 2))[..., 1:-2],  # a slice of a larger tensor
    "head_major": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),  # (H, T, .) memory
}


def native_varlen(p: Packed, *, left: int = LEFT, right: int = RIGHT, is_causal: bool = False,
                  scale: float = 0.37, dropout_p: float = 0.0, seed: Tensor | None = None,
                  layout: str = "contiguous") -> tuple[Tensor, Tensor]:
    """out (Tq, H, Dv) and lse (H, Tq) of the op."""
    view = LAYOUTS[layout]
    rk, rv = (None if t is None else view(t) for t in (p.rel_keys, p.rel_values))
    return torch.ops.relpos.native_attention_varlen(
        view(p.query), view(p.key), view(p.value), rk, rv, p.cu_q, p.cu_k, p.used_k, seed,
        left=left, right=right, is_causal=is_causal, scale=scale, dropout_p=dropout_p)


def _shared_or_per_head(table: Tensor | None) -> Tensor | None:
    """A (Hr, R, .) table as relative_attention takes it: (R, .) shared, (H, R, .) per head."""
    return table[0] if table is not None and table.shape[0] == 1 else table


def reference_varlen(p: Packed, *, left: int = LEFT, right: int = RIGHT,
                     is_causal: bool = False, scale: float = 0.37) -> Tensor:
    """out (Tq, H, Dv): each sequence through relpos.relative_attention's reference (zeros for
    queries without keys).

    relative_attention refuses more queries than keys (L > S) with relative positions; the
    same sequence is then L - S hidden keys (key_mask) followed by its own S: the offsets are
    the same, query i at position i of L keys and key j at L - S + j."""
    H, Dv = p.query.shape[1], p.value.shape[2]
    outs = [p.query.new_zeros(0, H, Dv)]
    for qs, ks in p.sequences():
        q, k, v = p.query[qs], p.key[ks], p.value[ks]
        L, S = q.shape[0], k.shape[0]
        if L == 0:
            continue
        if S == 0:
            outs.append(q.new_zeros(L, H, Dv))
            continue
        hidden = max(L - S, 0)
        k, v = (torch.cat([t.new_zeros(hidden, *t.shape[1:]), t]) for t in (k, v))
        key_mask = torch.arange(hidden + S) >= hidden
        out = relpos.relative_attention(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), max_distance=(left, right),
            rel_keys=_shared_or_per_head(p.rel_keys),
            rel_values=_shared_or_per_head(p.rel_values), key_mask=key_mask[None],
            is_causal=is_causal, scale=scale, implementation="reference")
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def relative_index(L: int, S: int, left: int, right: int) -> Tensor:
    """(L, S): the table row of (query i, key j), query i at position S - L + i (negative
    positions included, which relpos.relative_position_index refuses)."""
    offsets = torch.arange(S)[None, :] - (S - L + torch.arange(L))[:, None]
    return offsets.clamp(-left, right) + left


def definition_varlen(p: Packed, *, left: int = LEFT, right: int = RIGHT,
                      is_causal: bool = False, scale: float = 0.37,
                      keep: list[Tensor] | None = None,
                      dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """out (Tq, H, Dv) and lse (H, Tq) written out from the definition, per sequence, with the
    keep masks ``keep`` (one (H, L_s, S_s) each) applied as ``P * keep / (1 - dropout_p)``."""
    H, Dv = p.query.shape[1], p.value.shape[2]
    outs, lses = [p.query.new_zeros(0, H, Dv)], [p.query.new_zeros(H, 0)]
    for s, (qs, ks) in enumerate(p.sequences()):
        q, k, v = (t.transpose(0, 1) for t in (p.query[qs], p.key[ks], p.value[ks]))
        L, S = q.shape[1], k.shape[1]
        index = relative_index(L, S, left, right)  # (L, S)
        scores = q @ k.transpose(-1, -2)  # (H, L, S)
        if p.rel_keys is not None:
            scores = scores + torch.einsum("hld,hlsd->hls", q, p.rel_keys[:, index])
        scores = scores * scale
        if is_causal:
            hidden = torch.ones(L, S, dtype=torch.bool).tril(S - L).logical_not()
            scores = scores.masked_fill(hidden, -math.inf)
        lse = torch.logsumexp(scores, -1)  # (H, L), -inf where a row sees no key
        sees = torch.isfinite(lse)
        probs = torch.where(sees[..., None], torch.exp(scores - lse[..., None]), 0.0)
        if keep is not None:
            probs = probs * keep[s] / (1 - dropout_p)
        out = probs @ v
        if p.rel_values is not None:
            out = out + torch.einsum("hls,hlsd->hld", probs, p.rel_values[:, index])
        outs.append(out.transpose(0, 1))
        lses.append(torch.where(sees, lse, math.inf))
    return torch.cat(outs), torch.cat(lses, 1)


def gradients(out: Tensor, p: Packed, upstream: Tensor) -> list[Tensor]:
    return list(torch.autograd.grad(out, p.leaves(), upstream, allow_unused=True,
                                    materialize_grads=True))


def upstream_like(out: Tensor, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)


def assert_matches(got: Tensor, got_grads: list[Tensor], want: Tensor,
                   want_grads: list[Tensor], atol: float = 1e-11) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=10 * atol)


def test_the_kernels_are_built_here() -> None:
    assert native.available()


# ------------------------------------------------------------------------------------------
# Against the reference, float64


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("tables", sorted(TABLES))
@pytest.mark.parametrize("causal", [False, True])
def test_each_sequence_matches_the_reference(layout: str, tables: str, causal: bool) -> None:
    p = make_packed(LENGTHS, tables=TABLES[tables], seed=len(tables) + causal)
    out, lse = native_varlen(p, is_causal=causal, layout=layout)
    assert out.shape == (p.query.shape[0], 2, 3) and out.is_contiguous()
    want = reference_varlen(p, is_causal=causal)
    up = upstream_like(out)
    assert_matches(out, gradients(out, p, up), want, gradients(want, p, up))
    _, want_lse = definition_varlen(p, is_causal=causal)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_rows_that_see_no_key_give_zeros_and_zero_gradients() -> None:
    # sequence 0: no keys; sequence 1, causal with L > S: its first two rows see no key
    p = make_packed([(3, 0), (4, 2), (2, 2)], seed=3)
    out, lse = native_varlen(p, is_causal=True)
    blind = [0, 1, 2, 3, 4]
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    assert torch.equal(lse[:, blind], torch.full_like(lse[:, blind], math.inf))
    assert torch.isfinite(lse[:, 5:]).all()
    dq, dk, dv, drk, drv = gradients(out, p, upstream_like(out))
    assert torch.equal(dq[blind], torch.zeros_like(dq[blind]))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv, drk, drv))


@pytest.mark.parametrize("window", [(0, 0), (5, 0), (0, 4), (64, 8), (1, 70)])
@pytest.mark.parametrize("causal", [False, True])
def test_windows(window: tuple[int, int], causal: bool) -> None:
    left, right = window
    p = make_packed([(9, 90), (70, 70), (1, 3), (0, 5), (20, 9)], tables=("per_head", "shared"),
                    R=left + right + 1, seed=left * 10 + right)
    out, _ = native_varlen(p, left=left, right=right, is_causal=causal)
    want = reference_varlen(p, left=left, right=right, is_causal=causal)
    up = upstream_like(out)
    assert_matches(out, gradients(out, p, up), want, gradients(want, p, up))


@pytest.mark.parametrize("window", [(0, 0), (10**15, 10**15), (2, 10**18)])
def test_without_tables_any_window_changes_nothing(window: tuple[int, int]) -> None:
    # relpos passes (0, 0) without tables; the kernels stay safe for any window regardless
    p = make_packed(LENGTHS, tables=(None, None), seed=4)
    for causal in (False, True):
        out, lse = native_varlen(p, left=window[0], right=window[1], is_causal=causal)
        want, want_lse = definition_varlen(p, left=0, right=0, is_causal=causal)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_many_sequences_sum_the_table_gradients_by_groups() -> None:
    # more than 64 sequences with tables: the backward sums the table gradients per group of
    # sequences (varlen_gradient_groups)
    g = torch.Generator().manual_seed(5)
    lengths = [(int(a), int(b)) for a, b in torch.randint(0, 7, (90, 2), generator=g)]
    lengths[10] = (70, 80)
    p = make_packed(lengths, tables=("per_head", "shared"), seed=5)
    for causal in (False, True):
        out, _ = native_varlen(p, is_causal=causal)
        want = reference_varlen(p, is_causal=causal)
        up = upstream_like(out)
        assert_matches(out, gradients(out, p, up), want, gradients(want, p, up))


def test_a_batch_of_equal_lengths_is_the_padded_op() -> None:
    B, H, L, S, D, Dv = 3, 2, 70, 90, 5, 3
    p = make_packed([(L, S)] * B, H=H, D=D, Dv=Dv, tables=("per_head", "shared"), seed=6)

    def padded(t: Tensor, n: int) -> Tensor:  # (B * n, H, .) -> (B, H, n, .)
        return t.reshape(B, n, H, -1).transpose(1, 2)

    for causal in (False, True):
        out, lse = native_varlen(p, is_causal=causal)
        pad_out, pad_lse = torch.ops.relpos.native_attention(
            padded(p.query, L), padded(p.key, S), padded(p.value, S), p.rel_keys, p.rel_values,
            None, None, None, left=LEFT, right=RIGHT, is_causal=causal, scale=0.37,
            query_start=S - L, dropout_p=0.0)
        torch.testing.assert_close(lse.reshape(H, B, L).transpose(0, 1), pad_lse, rtol=0,
                                   atol=1e-12)
        up = upstream_like(out)
        assert_matches(padded(out, L), gradients(out, p, up), pad_out,
                       gradients(pad_out, p, padded(up, L)), atol=1e-12)


# ------------------------------------------------------------------------------------------
# Dropout in the kernel


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_is_the_exposed_masks_applied_to_the_definition(causal: bool) -> None:
    p = make_packed([*SMALL, (70, 80)], tables=("per_head", "shared"), seed=7)
    rate, seed = 0.3, torch.tensor([123, 456])
    out, lse = native_varlen(p, is_causal=causal, dropout_p=rate, seed=seed)
    keep = op.dropout_mask_varlen(seed, p.cu_q, p.cu_k, 2, rate)
    assert [tuple(m.shape) for m in keep] == [(2, qs.stop - qs.start, ks.stop - ks.start)
                                              for qs, ks in p.sequences()]
    want, want_lse = definition_varlen(p, is_causal=causal, keep=keep, dropout_p=rate)
    up = upstream_like(out)
    assert_matches(out, gradients(out, p, up), want, gradients(want, p, up), atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)  # dropout leaves lse alone


def test_dropout_masks_are_rows_of_the_padded_stream() -> None:
    # query i of sequence s, head h draws the padded row h * Tq + cu_q[s] + i: the mask of one
    # padded batch row of Tq queries
    p = make_packed(SMALL, seed=8)
    seed, rate = torch.tensor([5, 6]), 0.4
    Tq, S_max = p.query.shape[0], max(S for _, S in SMALL)
    padded = native.dropout_mask(seed, (1, 2, Tq, S_max), rate)[0]
    masks = native.dropout_mask_varlen(seed, p.cu_q, p.cu_k, 2, rate)
    for mask, (qs, ks) in zip(masks, p.sequences(), strict=True):
        assert torch.equal(mask, padded[:, qs, : ks.stop - ks.start])
    keep = torch.cat([m.flatten() for m in masks])
    assert 0.3 < 1 - keep.double().mean().item() < 0.5
    assert all(m.all() for m in op.dropout_mask_varlen(seed, p.cu_q, p.cu_k, 2, 0.0))


def test_dropout_needs_a_seed() -> None:
    p = make_packed(SMALL, seed=9)
    with pytest.raises(RuntimeError, match="seed"):
        native_varlen(p, dropout_p=0.2, seed=None)


# ------------------------------------------------------------------------------------------
# gradcheck, opcheck, torch.compile, threads


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_gradcheck(dropout_p: float) -> None:
    p = make_packed([(2, 3), (0, 2), (3, 2), (1, 0), (2, 2)], D=3, Dv=2,
                    tables=("per_head", "shared"), seed=10)
    seed = torch.tensor([1, 2]) if dropout_p else None

    def f(q: Tensor, k: Tensor, v: Tensor, ak: Tensor, av: Tensor) -> Tensor:
        return torch.ops.relpos.native_attention_varlen(
            q, k, v, ak, av, p.cu_q, p.cu_k, None, seed, left=LEFT, right=RIGHT, is_causal=True,
            scale=0.6, dropout_p=dropout_p)[0]

    assert torch.autograd.gradcheck(f, tuple(p.leaves()))


def test_opcheck() -> None:
    p = make_packed(SMALL, tables=("per_head", "shared"), seed=11)
    args = (p.query, p.key, p.value, p.rel_keys, p.rel_values, p.cu_q, p.cu_k, None, None)
    kw: dict[str, Any] = dict(left=LEFT, right=RIGHT, is_causal=True, scale=0.4, dropout_p=0.0)
    torch.library.opcheck(torch.ops.relpos.native_attention_varlen.default, args, kw)
    torch.library.opcheck(torch.ops.relpos.native_attention_varlen.default,
                          (*args[:8], torch.tensor([3, 4])), {**kw, "dropout_p": 0.3})
    keys_only = (p.query, p.key, p.value, p.rel_keys, None, p.cu_q, p.cu_k, None, None)
    torch.library.opcheck(torch.ops.relpos.native_attention_varlen.default, keys_only, kw)


def test_torch_compile_traces_batches_of_any_size_in_at_most_two_graphs() -> None:
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    def attend(q: Tensor, k: Tensor, v: Tensor, ak: Tensor, cu_q: Tensor,
               cu_k: Tensor) -> Tensor:
        out, _ = torch.ops.relpos.native_attention_varlen(
            q, k, v, ak, None, cu_q, cu_k, None, None, left=LEFT, right=RIGHT, is_causal=True,
            scale=0.5, dropout_p=0.0)
        return out * 2

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    for i, lengths in enumerate([[(3, 4), (4, 5)], [(2, 2), (5, 7), (5, 6)],
                                 [(6, 3), (2, 9), (4, 4), (7, 8), (3, 2)]]):
        # sizes that no other size equals in the first batch (duck sizing would tie them)
        p = make_packed(lengths, D=8, Dv=16, seed=20 + i)
        args = (p.query.detach(), p.key.detach(), p.value.detach(), p.rel_keys, p.cu_q, p.cu_k)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*args), attend(*args), rtol=0, atol=0)
    assert 1 <= len(graphs) <= 2, len(graphs)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [5, 90])
@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_the_same_at_one_and_two_threads(n: int, causal: bool,
                                                 restore_threads: None) -> None:
    g = torch.Generator().manual_seed(n)
    lengths = [(int(a), int(b)) for a, b in torch.randint(0, 40, (n, 2), generator=g)]
    lengths[1] = (150, 700)
    p = make_packed(lengths, H=3, D=16, Dv=8, tables=("per_head", "shared"), seed=n,
                    dtype=torch.float32)
    seed = torch.tensor([7, 8])
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out, lse = native_varlen(p, is_causal=causal, dropout_p=0.1, seed=seed)
        results.append([out, lse, *gradients(out, p, upstream_like(out))])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "drk", "drv"), *results,
                          strict=True):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max()} between 1 and 2 threads"


# ------------------------------------------------------------------------------------------
# seqused_k: each sequence uses the first keys of its key region (a KV cache with spare
# capacity); the spare rows hold NaN, so that any read of them shows

# (L_s, S_s) with the spare rows after each sequence's used keys: none used (with and without
# queries), all used, part used; L > S; several query blocks and key blocks.
USED = [(3, 0), (0, 0), (2, 5), (K, K), (K + 1, K - 1), (1, 1), (150, 140), (40, 600), (4, 9)]
SPARE = [4, 3, 0, 2, 1, 0, 30, 70, 5]


def compacted(p: Packed) -> Packed:
    """The same call without spare capacity: each sequence's used key rows end to end (new
    leaves, so that their gradients are the compacted call's own)."""
    keys = [ks for _, ks in p.sequences()]
    k, v = (torch.cat([t.detach()[ks] for ks in keys]).requires_grad_(True)
            for t in (p.key, p.value))
    lengths = torch.tensor([0, *(ks.stop - ks.start for ks in keys)], dtype=torch.int64)
    return replace(p, key=k, value=v, cu_k=lengths.cumsum(0), used_k=None)


@pytest.mark.parametrize("tables", ["both_shared", "both_per_head", "keys_only", "values_only",
                                    "none"])
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_matches_the_reference_on_the_used_rows(tables: str, causal: bool) -> None:
    p = make_packed(USED, tables=TABLES[tables], spare=SPARE, seed=30 + len(tables) + causal)
    assert p.used_k is not None and p.key[p.spare_rows()].isnan().all()
    out, lse = native_varlen(p, is_causal=causal)
    assert torch.isfinite(out).all()
    want = reference_varlen(p, is_causal=causal)
    up = upstream_like(out)
    got_grads = gradients(out, p, up)
    assert_matches(out, got_grads, want, gradients(want, p, up))
    _, want_lse = definition_varlen(p, is_causal=causal)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    spare = p.spare_rows()
    for grad in got_grads[1:3]:  # dk, dv: zero in the spare rows
        assert torch.equal(grad[spare], torch.zeros_like(grad[spare]))


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_is_bitwise_the_compacted_call(causal: bool) -> None:
    # the same geometry per sequence, the same dropout rows and local key indices, the same
    # table-gradient groups: the same bits, with dropout and more than 64 sequences too
    g = torch.Generator().manual_seed(31)
    lengths = [(int(a), int(b)) for a, b in torch.randint(0, 9, (90, 2), generator=g)]
    lengths[3] = (70, 600)
    spare = [int(n) for n in torch.randint(0, 5, (90,), generator=g)]
    p = make_packed(lengths, H=3, D=16, Dv=8, tables=("per_head", "shared"), spare=spare,
                    seed=31, dtype=torch.float32)
    c = compacted(p)
    seed = torch.tensor([9, 10])
    out, lse = native_varlen(p, is_causal=causal, dropout_p=0.2, seed=seed)
    want, want_lse = native_varlen(c, is_causal=causal, dropout_p=0.2, seed=seed)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    up = upstream_like(out)
    dq, dk, dv, drk, drv = gradients(out, p, up)
    cq, ck, cv, crk, crv = gradients(want, c, up)
    used = ~p.spare_rows()
    for got, expected in ((dq, cq), (dk[used], ck), (dv[used], cv), (drk, crk), (drv, crv)):
        assert torch.equal(got, expected)
    assert not dk[~used].any() and not dv[~used].any()


def test_seqused_k_every_key_used_or_none() -> None:
    # seqused_k equal to the regions is the call without it; all 0: no row sees a key
    p = make_packed(LENGTHS, tables=("per_head", "shared"), seed=32)
    full = replace(p, used_k=p.cu_k.diff())
    for causal in (False, True):
        out, lse = native_varlen(full, is_causal=causal)
        want, want_lse = native_varlen(p, is_causal=causal)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    empty = make_packed([(L, 0) for L, _ in LENGTHS], tables=("per_head", "shared"),
                        spare=[S for _, S in LENGTHS], seed=33)
    out, lse = native_varlen(empty)
    assert torch.equal(out, torch.zeros_like(out)) and (lse == math.inf).all()
    grads = gradients(out, empty, upstream_like(out))
    assert all(torch.equal(t, torch.zeros_like(t)) for t in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_dropout_is_the_exposed_masks_applied(causal: bool) -> None:
    p = make_packed([*USED, (70, 80)], tables=("per_head", "shared"), spare=[*SPARE, 9],
                    seed=34)
    rate, seed = 0.3, torch.tensor([321, 654])
    out, _ = native_varlen(p, is_causal=causal, dropout_p=rate, seed=seed)
    keep = op.dropout_mask_varlen(seed, p.cu_q, p.cu_k, 2, rate, p.used_k)
    assert [tuple(m.shape) for m in keep] == [(2, qs.stop - qs.start, ks.stop - ks.start)
                                              for qs, ks in p.sequences()]
    c = compacted(p)  # the same masks: key j is the sequence's j-th key either way
    compact_keep = native.dropout_mask_varlen(seed, c.cu_q, c.cu_k, 2, rate)
    assert all(torch.equal(a, b) for a, b in zip(keep, compact_keep, strict=True))
    want, _ = definition_varlen(p, is_causal=causal, keep=keep, dropout_p=rate)
    up = upstream_like(out)
    assert_matches(out, gradients(out, p, up), want, gradients(want, p, up), atol=1e-12)


def test_seqused_k_opcheck_gradcheck_and_compile() -> None:
    p = make_packed([(2, 3), (0, 2), (3, 3), (1, 0), (2, 2)], D=3, Dv=2,
                    tables=("per_head", "shared"), spare=[2, 1, 0, 3, 1], spare_value=None,
                    seed=35)
    assert p.used_k is not None
    args = (*p.leaves(), p.cu_q, p.cu_k, p.used_k, None)
    kw: dict[str, Any] = dict(left=LEFT, right=RIGHT, is_causal=True, scale=0.4, dropout_p=0.0)
    torch.library.opcheck(torch.ops.relpos.native_attention_varlen.default, args, kw)
    torch.library.opcheck(torch.ops.relpos.native_attention_varlen.default,
                          (*args[:8], torch.tensor([3, 4])), {**kw, "dropout_p": 0.3})

    def f(q: Tensor, k: Tensor, v: Tensor, ak: Tensor, av: Tensor) -> Tensor:
        return torch.ops.relpos.native_attention_varlen(
            q, k, v, ak, av, p.cu_q, p.cu_k, p.used_k, None, **kw)[0]

    assert torch.autograd.gradcheck(f, tuple(p.leaves()))
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    def attend(q: Tensor, k: Tensor, v: Tensor, ak: Tensor, av: Tensor, cu_q: Tensor,
               cu_k: Tensor, used: Tensor) -> Tensor:
        return torch.ops.relpos.native_attention_varlen(
            q, k, v, ak, av, cu_q, cu_k, used, None, **kw)[0] * 2

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    inputs = (*(t.detach() for t in p.leaves()), p.cu_q, p.cu_k, p.used_k)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), attend(*inputs), rtol=0, atol=0)
    assert len(graphs) == 1


# ------------------------------------------------------------------------------------------
# Half precision


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_is_close_to_float64(dtype: torch.dtype, tol: float) -> None:
    p = make_packed([*SMALL, (70, 80)], D=16, Dv=8, tables=("per_head", "shared"), seed=12)
    low = replace(p, **{name: None if t is None else t.detach().to(dtype).requires_grad_(True)
                        for name, t in vars(p).items() if name in
                        ("query", "key", "value", "rel_keys", "rel_values")})
    out, lse = native_varlen(low, is_causal=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    want = reference_varlen(p, is_causal=True)
    up = upstream_like(want)
    got_grads = gradients(out, low, up.to(dtype))
    assert all(g.dtype == dtype for g in got_grads)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
    for a, b in zip(got_grads, gradients(want, p, up), strict=True):  # relative to the largest
        torch.testing.assert_close(a.double(), b, rtol=0, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("engine", ["amx", "avx512bf16", "brgemm", "widened"])
def test_bfloat16_never_reads_the_spare_rows(engine: str, causal: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 with seqused_k, the spare rows NaN: on packed tiles (AMX, or VDPBF16PS: a
    head's key tiles packed once, the last one from its used rows only), on libtorch's brgemm
    and on widened tiles (an engine the build or CPU lacks runs as the next), several query
    blocks and key tiles per sequence; the output and every gradient finite,
    within twice the bfloat16 reference's error of the float64 truth, the spare rows' gradients
    zero."""
    monkeypatch.setenv("RELPOS_NATIVE_BF16_GEMM", engine)
    lengths, spare = [(150, 140), (40, 600), (300, 700), (4, 9)], [30, 70, 40, 5]
    p = make_packed(lengths, D=32, Dv=16, spare=spare, seed=14)

    def cast(dtype: torch.dtype) -> Packed:
        return replace(p, **{name: None if t is None else t.detach().to(dtype).bfloat16()
                             .to(dtype).requires_grad_(True)
                             for name, t in vars(p).items() if name in
                             ("query", "key", "value", "rel_keys", "rel_values")})

    low, exact = cast(torch.bfloat16), cast(F64)  # the same rounded inputs
    out, _ = native_varlen(low, is_causal=causal)
    truth, ref = (reference_varlen(x, is_causal=causal) for x in (exact, low))
    up = upstream_like(truth)
    got = [out, *gradients(out, low, up.bfloat16())]
    want = [truth, *gradients(truth, exact, up)]
    mine = [ref, *gradients(ref, low, up.bfloat16())]
    spare_rows = p.spare_rows()
    assert not got[2][spare_rows].any() and not got[3][spare_rows].any()
    for name, a, t, r in zip(("out", "dq", "dk", "dv", "drel_keys", "drel_values"), got, want,
                             mine, strict=True):
        assert torch.isfinite(a).all(), name
        keep = ~spare_rows if name in ("dk", "dv") else slice(None)
        a, t, r = (x.detach().double() for x in (a, t, r))
        e, re = (float((x - t)[keep].abs().max()) for x in (a, r))
        assert e <= 2 * re + 1e-5, f"{name}: error {e:.3g} > 2 x reference error {re:.3g}"


# ------------------------------------------------------------------------------------------
# Empty calls and bad input


def test_empty_calls_run_no_kernel_and_give_zero_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernels() -> None:
        raise AssertionError("an empty call ran a kernel")

    monkeypatch.setattr(op, "_kernels", no_kernels)
    for lengths, H in (([(0, 5), (0, 0)], 2), ([(4, 0), (3, 0)], 2), ([(2, 3)], 0)):
        p = make_packed(lengths, H=H, seed=13)
        out, lse = native_varlen(p)
        assert out.shape == (p.query.shape[0], H, 3) and torch.equal(out, torch.zeros_like(out))
        assert lse.shape == (H, p.query.shape[0]) and (lse == math.inf).all()
        grads = gradients(out, p, torch.ones_like(out))
        assert all(torch.equal(t, torch.zeros_like(t)) for t in grads)


def _options(**options: Any) -> object:
    kw: dict[str, Any] = dict(left=LEFT, right=RIGHT, is_causal=False, scale=0.5, query_start=0,
                              dropout_p=0.0)
    return op._kernels().AttentionOptions(**{**kw, **options})


def _detached(p: Packed) -> list[Tensor | None]:
    return [None if t is None else t.detach()
            for t in (p.query, p.key, p.value, p.rel_keys, p.rel_values)]


def _kernel_forward(p: Packed, **options: Any) -> tuple[Tensor, Tensor]:
    """The kernels' forward_varlen called directly, past every check in Python."""
    q, k, v, rk, rv = _detached(p)
    return op._kernels().forward_varlen(q, k, v, p.cu_q, p.cu_k, p.used_k, rk, rv, None,
                                        _options(**options))


def _kernel_backward(p: Packed, out: Tensor, lse: Tensor, **options: Any) -> list[Tensor]:
    """The kernels' backward_varlen called directly (upstream gradient: ones)."""
    q, k, v, rk, rv = _detached(p)
    return op._kernels().backward_varlen(torch.ones_like(out), q, k, v, p.cu_q, p.cu_k,
                                         p.used_k, rk, rv, None, out, lse, _options(**options))


def test_the_kernels_alone_handle_calls_without_keys() -> None:
    # what the op never hands them (it runs no kernel then): safe all the same
    p = make_packed([(4, 0), (3, 0)], seed=14)
    out, lse = _kernel_forward(p)
    assert out.shape == (7, 2, 3) and torch.equal(out, torch.zeros_like(out))
    assert (lse == math.inf).all()
    grads = _kernel_backward(p, out, lse)
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in p.leaves()]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def _with(p: Packed, **changes: Any) -> Packed:
    return replace(p, **changes)


BAD_INPUTS: dict[str, tuple[Callable[[Packed], Packed], str]] = {
    "cu float": (lambda p: _with(p, cu_q=p.cu_q.double()), "1-D int64 CPU"),
    "cu 2-D": (lambda p: _with(p, cu_q=p.cu_q[None]), "1-D int64 CPU"),
    "cu empty": (lambda p: _with(p, cu_q=p.cu_q[:0], cu_k=p.cu_k[:0]), "first entry"),
    "cu not from 0": (lambda p: _with(p, cu_k=p.cu_k + 1), "start at 0"),
    "cu decreasing": (lambda p: _with(p, cu_q=torch.tensor([0, 5, 2, 8])), "non-decreasing"),
    "cu short of the rows": (lambda p: _with(p, cu_q=torch.tensor([0, 2, 3, 7])), "must end"),
    "cu past the rows": (lambda p: _with(p, cu_k=torch.tensor([0, 2, 3, 99])), "must end"),
    "cu lengths differ": (lambda p: _with(p, cu_k=torch.tensor([0, 4, 11])), "one length"),
    "query 4-D": (lambda p: _with(p, query=p.query[None]), "3-D"),
    "heads differ": (lambda p: _with(p, key=p.key[:, :1]), "do not match"),
    "head dims differ": (lambda p: _with(p, key=p.key[..., :4]), "do not match"),
    "value rows": (lambda p: _with(p, value=p.value[:-1]), "do not match"),
    "table heads": (lambda p: _with(p, rel_keys=p.rel_keys.expand(3, -1, -1)), "tables must"),
    "table width": (lambda p: _with(p, rel_values=p.rel_keys), "tables must"),
    "table rows": (lambda p: _with(p, rel_keys=p.rel_keys[:, 1:]), "table rows"),
    "table 2-D": (lambda p: _with(p, rel_keys=p.rel_keys[0]), "tables must"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_the_kernels_check_their_input(case: str) -> None:
    change, message = BAD_INPUTS[case]
    p = change(make_packed([(3, 4), (0, 2), (5, 5)], seed=15))  # Tq = 8, Tk = 11
    with pytest.raises(RuntimeError, match=message):
        _kernel_forward(p)


def test_the_backward_kernel_checks_out_and_lse() -> None:
    p = make_packed([(3, 4), (2, 5)], seed=16)
    out, lse = native_varlen(p)
    q, k, v, rk, rv = _detached(p)
    for o, lse_ in ((out[:-1], lse), (out, lse[:, :-1]), (out, lse.t())):
        with pytest.raises(RuntimeError, match="must be"):
            op._kernels().backward_varlen(o.detach(), q, k, v, p.cu_q, p.cu_k, None, rk, rv,
                                          None, o.detach(), lse_, _options())
    with pytest.raises(RuntimeError, match="query_start must be 0"):
        _kernel_forward(p, query_start=1)


BAD_SEQUSED: dict[str, tuple[Callable[[Tensor], Tensor], str]] = {
    "int32": (lambda u: u.int(), "1-D int64 CPU"),
    "float": (lambda u: u.double(), "1-D int64 CPU"),
    "2-D": (lambda u: u[None], "1-D int64 CPU"),
    "short": (lambda u: u[:-1], "one entry per sequence"),
    "long": (lambda u: torch.cat([u, u[:1]]), "one entry per sequence"),
    "negative": (lambda u: torch.tensor([-1, 0, 5]), r"seqused_k\[0\] must be in \[0, 6\]"),
    "past the region": (lambda u: torch.tensor([6, 3, 5]),
                        r"seqused_k\[1\] must be in \[0, 2\]"),
    "past the keys": (lambda u: torch.tensor([0, 0, 10**6]),
                      r"seqused_k\[2\] must be in \[0, 5\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_SEQUSED))
def test_the_kernels_check_seqused_k(case: str) -> None:
    # regions of 6, 2 and 5 keys (Tq = 8, Tk = 13), using 4, 0 and 5 of them
    change, message = BAD_SEQUSED[case]
    p = make_packed([(3, 4), (0, 0), (5, 5)], spare=[2, 2, 0], seed=36)
    assert p.used_k is not None
    out, lse = _kernel_forward(p)
    bad = replace(p, used_k=change(p.used_k))
    with pytest.raises(RuntimeError, match=message):
        _kernel_forward(bad)
    with pytest.raises(RuntimeError, match=message):
        _kernel_backward(bad, out, lse)
    with pytest.raises(RuntimeError, match=message):
        op.dropout_mask_varlen(torch.tensor([1, 2]), p.cu_q, p.cu_k, 2, 0.5, bad.used_k)
