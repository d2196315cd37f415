"""Packed variable-length batches (relpos.varlen): every backend against the definition (one
reference call per sequence) in float64, forward and all five gradients; ``seqused_k`` (key
regions with spare capacity) against the compacted packing on every backend; auto-selection;
pack / unpack; the modules and layers on packed input against the same padded batch; bad
input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import relpos
from relpos.ops.native import build
from relpos.varlen import cu_seqlens_from_lengths, pack, relative_attention_varlen, unpack

K = 3
# Awkward boundaries: empty sequences, 1, 2, K - 1, K, K + 1 and a long one; keys >= queries.
LENGTHS_Q = [0, 1, 2, K - 1, K, K + 1, 37, 0, 5]
LENGTHS_K = [0, 1, 4, K - 1, K + 2, K + 1, 40, 3, 9]
BACKENDS = ["reference", "bucketed", "flash_regions", "native"]
NATIVE = build.load(quiet=True) is not None


def _inputs(lq: list[int], lk: list[int], *, H: int = 2, D: int = 4, Dv: int = 3,
            dtype: torch.dtype = torch.float64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lq), sum(lk)
    return dict(
        query=torch.randn(Tq, H, D, generator=g, dtype=dtype, requires_grad=True),
        key=torch.randn(Tk, H, D, generator=g, dtype=dtype, requires_grad=True),
        value=torch.randn(Tk, H, Dv, generator=g, dtype=dtype, requires_grad=True),
        cu_seqlens_q=cu_seqlens_from_lengths(lq), cu_seqlens_k=cu_seqlens_from_lengths(lk),
    )


def _tables(window: tuple[int, int], H: int, D: int, Dv: int, per_head: bool, which: str,
            dtype: torch.dtype = torch.float64) -> dict:
    g = torch.Generator().manual_seed(1)
    R = window[0] + window[1] + 1
    lead = (H,) if per_head else ()
    out = {}
    if which in ("both", "keys"):
        out["rel_keys"] = torch.randn(*lead, R, D, generator=g, dtype=dtype, requires_grad=True)
    if which in ("both", "values"):
        out["rel_values"] = torch.randn(*lead, R, Dv, generator=g, dtype=dtype,
                                        requires_grad=True)
    return out


def _definition(x: dict, lq: list[int], lk: list[int], **kwargs: object) -> torch.Tensor:
    """One reference call per sequence, ``(Tq, H, Dv)``."""
    outs = []
    q0 = k0 = 0
    H, Dv = x["value"].shape[1], x["value"].shape[2]
    for L, S in zip(lq, lk, strict=True):
        q = x["query"][q0:q0 + L].transpose(0, 1).unsqueeze(0)
        k = x["key"][k0:k0 + S].transpose(0, 1).unsqueeze(0)
        v = x["value"][k0:k0 + S].transpose(0, 1).unsqueeze(0)
        if L and S:
            out = relpos.relative_attention(q, k, v, implementation="reference", **kwargs)
            outs.append(out[0].transpose(0, 1))
        elif L:
            outs.append(q.new_zeros(L, H, Dv) + 0 * q.sum())
        q0, k0 = q0 + L, k0 + S
    return torch.cat(outs)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return list(torch.autograd.grad((out * w).sum(), inputs, allow_unused=True))


@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize(("is_causal", "window", "tables", "per_head"), [
    (False, (K, K), "both", False),
    (True, (K, K), "both", True),
    (False, (1, 4), "keys", False),
    (True, (4, 0), "values", True),
    (True, (K, K), "none", False),
])
def test_packed_equals_one_reference_call_per_sequence(
        implementation: str, is_causal: bool, window: tuple[int, int], tables: str,
        per_head: bool) -> None:
    if implementation == "native" and not NATIVE:
        pytest.skip("the native kernels are not built here")
    Dv = 4 if implementation == "flash_regions" else 3  # the flash kernels need Dv == D
    x = _inputs(LENGTHS_Q, LENGTHS_K, Dv=Dv)
    t = _tables(window, 2, 4, Dv, per_head, tables)
    kwargs = dict(max_distance=window, is_causal=is_causal, **t)
    out = relative_attention_varlen(**x, **kwargs, implementation=implementation)
    ref = _definition(x, LENGTHS_Q, LENGTHS_K, **kwargs)
    assert out.shape == ref.shape == (sum(LENGTHS_Q), 2, Dv)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    inputs = [x["query"], x["key"], x["value"], *t.values()]
    for got, want in zip(_grads(out, inputs), _grads(ref, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


# Spare rows after each sequence's used keys (LENGTHS_K): a region none of which is used, full
# regions, partly used ones.
SPARE_K = [3, 0, 2, 1, 0, 4, 10, 5, 0]


def _with_spare(x: dict, lk: list[int], spare: list[int]) -> dict:
    """``x`` (keys packed by ``lk``) with ``spare[s]`` NaN rows after sequence s's keys: new
    leaves, ``cu_seqlens_k`` the regions, ``seqused_k`` int32 the used lengths."""
    H = x["key"].shape[1]
    starts = [0, *itertools.accumulate(lk)]
    out = dict(x)
    for name in ("key", "value"):
        t = x[name].detach()
        parts = []
        for s, n in enumerate(spare):
            parts.append(t[starts[s]:starts[s + 1]])
            parts.append(t.new_full((n, H, t.shape[2]), float("nan")))
        out[name] = torch.cat(parts).requires_grad_(True)
    out["cu_seqlens_k"] = cu_seqlens_from_lengths([S + n for S, n in zip(lk, spare,
                                                                         strict=True)])
    out["seqused_k"] = torch.tensor(lk, dtype=torch.int32)
    return out


def _used_rows(lk: list[int], spare: list[int]) -> torch.Tensor:
    return torch.cat([torch.cat([torch.ones(S, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)])
                      for S, n in zip(lk, spare, strict=True)])


@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize(("is_causal", "window", "tables", "per_head"), [
    (False, (K, K), "both", False),
    (True, (K, K), "both", True),
    (True, (4, 0), "values", True),
    (False, (1, 4), "none", False),
])
def test_seqused_k_equals_the_compacted_call(
        implementation: str, is_causal: bool, window: tuple[int, int], tables: str,
        per_head: bool) -> None:
    if implementation == "native" and not NATIVE:
        pytest.skip("the native kernels are not built here")
    Dv = 4 if implementation == "flash_regions" else 3
    compact = _inputs(LENGTHS_Q, LENGTHS_K, Dv=Dv, seed=2)
    spare = _with_spare(compact, LENGTHS_K, SPARE_K)
    t = _tables(window, 2, 4, Dv, per_head, tables)
    kwargs = dict(max_distance=window, is_causal=is_causal, implementation=implementation, **t)
    out = relative_attention_varlen(**spare, **kwargs)
    want = relative_attention_varlen(**compact, **kwargs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    used = _used_rows(LENGTHS_K, SPARE_K)
    got = _grads(out, [spare["query"], spare["key"], spare["value"], *t.values()])
    expected = _grads(want, [compact["query"], compact["key"], compact["value"], *t.values()])
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if i in (1, 2):  # dk, dv: the compacted call's in the used rows, zero in the spare
            assert not a[~used].any()
            a = a[used]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_seqused_k_zero_gives_zeros_and_counts_in_the_checks() -> None:
    x = _with_spare(_inputs([2, 3], [2, 3]), [2, 3], [1, 2])  # regions 3 and 5
    x["seqused_k"] = torch.tensor([0, 3])
    out = relative_attention_varlen(**x, max_distance=2)  # plain attention: L > S is legal
    assert not out[:2].any() and torch.isfinite(out).all()
    # the used lengths are the sequences' key lengths: max_seqlen_k, L <= S
    relative_attention_varlen(**x, max_distance=2, max_seqlen_k=3)
    with pytest.raises(ValueError, match="max_seqlen_k=2 is smaller than the longest "
                                         "sequence, 3"):
        relative_attention_varlen(**x, max_distance=2, max_seqlen_k=2)
    with pytest.raises(ValueError, match=r"sequence 0 has 2 queries but uses 0 keys "
                                         r"\(seqused_k\)"):
        relative_attention_varlen(**x, max_distance=2, is_causal=True)
    if NATIVE:
        assert relpos.select_backend_varlen(**x, max_distance=2) == "native"
        assert relpos.explain_backends_varlen(**x, max_distance=2)["native"] is None
    full = _inputs([2, 3], [3, 5])  # every key used: the call without seqused_k
    for implementation in ("reference", "native" if NATIVE else "bucketed"):
        torch.testing.assert_close(
            relative_attention_varlen(**full, max_distance=2, implementation=implementation,
                                      seqused_k=torch.tensor([3, 5])),
            relative_attention_varlen(**full, max_distance=2, implementation=implementation),
            rtol=0, atol=0)


def test_auto_selection_takes_the_native_kernels_for_one_call() -> None:
    x = _inputs([3, 5], [3, 5])
    if NATIVE:
        assert relpos.select_backend_varlen(**x, max_distance=2) == "native"
        reasons = relpos.explain_backends_varlen(**x, max_distance=2)
        assert next(iter(reasons)) == "native" and reasons["native"] is None
    else:  # pragma: no cover - CI builds the kernels
        assert relpos.select_backend_varlen(**x, max_distance=2) != "native"


def test_without_the_native_kernels_each_sequence_takes_the_padded_choice(
        no_native: None) -> None:
    x = _inputs([3, 5], [3, 5])
    reasons = relpos.explain_backends_varlen(**x, max_distance=2)
    assert "RELPOS_NATIVE=0" in str(reasons["native"])
    chosen = relpos.select_backend_varlen(**x, max_distance=2)
    assert chosen != "native" and reasons[chosen] is None
    out = relative_attention_varlen(**x, max_distance=2)
    torch.testing.assert_close(out, _definition(x, [3, 5], [3, 5], max_distance=2))
    with pytest.raises(RuntimeError, match="'native' cannot serve this packed call"):
        relative_attention_varlen(**x, max_distance=2, implementation="native")


def test_every_sequence_empty_gives_an_empty_or_zero_result() -> None:
    x = _inputs([0, 0], [0, 0])
    out = relative_attention_varlen(**x, max_distance=2, is_causal=True)
    assert out.shape == (0, 2, 3)
    x = _inputs([2], [0])  # queries without keys: zeros (no relative terms: L > S is legal)
    out = relative_attention_varlen(**x, max_distance=2)
    assert out.shape == (2, 2, 3) and not out.any()


def test_half_precision_packed_matches_float64() -> None:
    if not NATIVE:
        pytest.skip("the native kernels are not built here")
    x = _inputs(LENGTHS_Q, LENGTHS_K)
    t = _tables((K, K), 2, 4, 3, False, "both")
    ref = relative_attention_varlen(**x, max_distance=K, is_causal=True, **t)
    for dtype in (torch.bfloat16, torch.float16):
        low = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in x.items()}
        lt = {k: v.detach().to(dtype) for k, v in t.items()}
        out = relative_attention_varlen(**low, max_distance=K, is_causal=True, **lt)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=5e-2)


# ------------------------------------------------------------------------------------------
# pack / unpack


def test_pack_and_unpack_are_inverse_with_holes_and_without_a_mask() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 3, generator=g)
    padding = torch.rand(4, 6, generator=g) < 0.4
    padding[1] = True  # a row without any real token
    packed, cu = pack(x, padding)
    assert cu.dtype == torch.int32 and cu.tolist()[-1] == packed.shape[0] == int((~padding).sum())
    back = unpack(packed, cu, padding, padding_value=-7.0)
    assert torch.equal(back[~padding], x[~padding]) and (back[padding] == -7.0).all()
    right = pack(x)[0]
    assert torch.equal(unpack(right, cu_seqlens_from_lengths([6] * 4)), x)
    lengths = [2, 0, 5]
    short = unpack(torch.arange(7.0), cu_seqlens_from_lengths(lengths), max_seqlen=6)
    assert short.shape == (3, 6) and short[2, :5].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: pack(torch.zeros(3)), ValueError, r"x must be \(B, L, ...\)"),
    (lambda: pack(torch.zeros(2, 3), torch.zeros(2, 3)), TypeError, "must be bool"),
    (lambda: pack(torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.bool)), ValueError,
     r"shape \(B, L\) = \(2, 3\)"),
    (lambda: unpack(torch.zeros(5), torch.tensor([0, 2, 4])), ValueError,
     "must end at the packed length 5"),
    (lambda: unpack(torch.zeros(5), torch.tensor([0, 2, 5]), max_seqlen=2), ValueError,
     "max_seqlen=2 is smaller than the longest sequence, 3"),
    (lambda: unpack(torch.zeros(5), torch.tensor([0, 2, 5]),
                    torch.zeros(2, 4, dtype=torch.bool)), ValueError, r"real tokens per row"),
    (lambda: cu_seqlens_from_lengths([2, -1]), ValueError, "non-negative integers"),
    (lambda: cu_seqlens_from_lengths([2**31 - 1, 5]), ValueError,
     r"lengths sum to 2147483652, more than torch.int32 holds \(2147483647\); pass "
     r"dtype=torch.int64"),
    (lambda: cu_seqlens_from_lengths([2**62, 2**62], dtype=torch.int64), ValueError,
     "lengths sum to 9223372036854775808, more than torch.int64 holds"),
    (lambda: cu_seqlens_from_lengths([True, False]), ValueError, "non-negative integers"),
    (lambda: cu_seqlens_from_lengths([2, 3], dtype=torch.float32), TypeError,
     "dtype must be torch.int32 or torch.int64"),
    (lambda: unpack(torch.zeros(5), torch.tensor([0, 2, 5]), max_seqlen=4.0), TypeError,
     "max_seqlen must be an int or None, got 4.0"),
])
def test_pack_and_unpack_refuse_bad_input(call: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()  # type: ignore[operator]


def test_cumulative_lengths_never_wrap() -> None:
    # int32 ends past 2**31 - 1 are refused (above); int64 holds them
    assert cu_seqlens_from_lengths([2**31 - 1, 5], dtype=torch.int64).tolist() == [
        0, 2**31 - 1, 2**31 + 4]
    assert cu_seqlens_from_lengths(torch.tensor([3, 4], dtype=torch.int32)).tolist() == [0, 3, 7]
    assert cu_seqlens_from_lengths([]).tolist() == [0]


# ------------------------------------------------------------------------------------------
# Bad input


def _bad(**change: object) -> dict:
    x = _inputs([2, 3], [2, 3])
    x.update(change)
    return x


@pytest.mark.parametrize(("change", "error", "match"), [
    (dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0])), TypeError,
     "cu_seqlens_q must be int32 or int64"),
    (dict(cu_seqlens_k=torch.tensor([[0, 2, 5]])), ValueError, "cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_q=torch.tensor([1, 2, 5])), ValueError, "must start at 0, got 1"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 3, 5])), ValueError,
     "must not decrease, got 4 then 3"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 4])), ValueError,
     "cu_seqlens_k must end at the packed length 5, got 4"),
    (dict(cu_seqlens_k=torch.tensor([0, 5])), ValueError,
     "the same number of sequences, got 2 and 1"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q=2 is smaller than the longest sequence, 3"),
    (dict(max_seqlen_k=2.5), TypeError, "max_seqlen_k must be an int or None"),
    (dict(max_seqlen_q=True), TypeError, "max_seqlen_q must be an int or None, got True"),
    (dict(max_seqlen_q=np.int64(2)), ValueError,
     "max_seqlen_q=2 is smaller than the longest sequence, 3"),
    (dict(query=torch.zeros(1, 5, 2, 4, dtype=torch.float64)), ValueError,
     r"query must be 3-D \(Tq, H, D\)"),
    (dict(key=torch.zeros(5, 3, 4, dtype=torch.float64)), ValueError, "head counts differ"),
    (dict(value=torch.zeros(5, 2, 3)), TypeError, "share one dtype"),
    (dict(query=torch.zeros(5, 2, 4, dtype=torch.int64)), TypeError, "floating point"),
    (dict(cu_seqlens_q=[0, 2, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (dict(seqused_k=[2, 3]), TypeError, "seqused_k must be a torch.Tensor, got list"),
    (dict(seqused_k=torch.tensor([2.0, 3.0])), TypeError,
     "seqused_k must be int32 or int64 .*, got dtype torch.float32"),
    (dict(seqused_k=torch.tensor([[2, 3]])), ValueError,
     r"seqused_k must be 1-D with one entry per sequence \(N = 2, .*got shape \(1, 2\)"),
    (dict(seqused_k=torch.tensor([2, 3, 0])), ValueError,
     r"one entry per sequence \(N = 2, .*got shape \(3,\)"),
    (dict(seqused_k=torch.tensor([-1, 3])), ValueError,
     r"seqused_k\[0\] = -1 is outside \[0, 2\]"),
    (dict(seqused_k=torch.tensor([2, 4])), ValueError,
     r"seqused_k\[1\] = 4 is outside \[0, 3\].*cu_seqlens_k\[2\] - cu_seqlens_k\[1\] = 3"),
])
def test_bad_packed_input_is_refused_naming_what_and_what_is_allowed(
        change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        relative_attention_varlen(**_bad(**change), max_distance=2)


def test_integer_like_max_seqlen_is_accepted_as_pytorch_and_flash_attention_take_it() -> None:
    x = _inputs([2, 3], [2, 3])
    want = relative_attention_varlen(**x, max_distance=2)
    for n in (np.int64(3), np.int32(3), torch.tensor(3), 3):
        got = relative_attention_varlen(**x, max_distance=np.int64(2), max_seqlen_q=n,
                                        max_seqlen_k=n)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    padded = unpack(torch.arange(5.0), torch.tensor([0, 2, 5]), max_seqlen=np.int64(4))
    assert padded.shape == (2, 4)


def test_more_queries_than_keys_needs_no_relative_terms() -> None:
    x = _inputs([3, 2], [2, 2])
    with pytest.raises(ValueError, match="sequence 0 has 3 queries but 2 keys"):
        relative_attention_varlen(**x, max_distance=2, is_causal=True)
    t = torch.randn(5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="need L <= S in every sequence"):
        relative_attention_varlen(**x, max_distance=2, rel_keys=t)
    relative_attention_varlen(**x, max_distance=2)  # plain attention: any lengths


def test_a_table_of_the_wrong_size_is_refused_as_in_the_padded_call() -> None:
    with pytest.raises(ValueError, match=r"rel_keys has 3 rows .* needs 2K\+1 = 5"):
        relative_attention_varlen(**_bad(), max_distance=2,
                                  rel_keys=torch.zeros(3, 4, dtype=torch.float64))


# ------------------------------------------------------------------------------------------
# Modules and layers: a padded batch through the packed path gives the padded path's numbers


LENGTHS = [5, 1, 9, 3]


def _padded_batch(E: int = 16, dtype: torch.dtype = torch.float64):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    B, L = len(LENGTHS), max(LENGTHS)
    x = torch.randn(B, L, E, generator=g, dtype=dtype)
    padding = torch.arange(L)[None, :] >= torch.tensor(LENGTHS)[:, None]  # True = padding
    return x, padding


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_module_packed_equals_padded_on_the_real_tokens(is_causal: bool) -> None:
    torch.manual_seed(0)
    mha = relpos.RelativeMultiheadAttention(16, 4, batch_first=True, max_distance=3,
                                            dtype=torch.float64)
    x, padding = _padded_batch()
    padded, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False, is_causal=is_causal)
    packed, cu = pack(x, padding)
    out, weights = mha(packed, cu_seqlens=cu, is_causal=is_causal)
    assert weights is None and out.shape == packed.shape
    torch.testing.assert_close(out, padded[~padding], rtol=0, atol=1e-12)
    # gradients of the parameters agree too
    g_packed = torch.autograd.grad(out.sum(), [mha.rel_keys, mha.in_proj_weight])
    padded, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False, is_causal=is_causal)
    g_padded = torch.autograd.grad(padded[~padding].sum(), [mha.rel_keys, mha.in_proj_weight])
    for a, b in zip(g_packed, g_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_and_decoder_layers_packed_equal_padded(norm_first: bool) -> None:
    torch.manual_seed(0)
    kw = dict(batch_first=True, max_distance=3, dropout=0.0, norm_first=norm_first,
              dtype=torch.float64)
    enc = relpos.RelativeTransformerEncoderLayer(16, 4, 32, **kw)
    # Plain cross-attention: a padded memory moves relative cross-attention's positions (its
    # queries align to the padded end), so only the plain one has the same numbers.
    dec = relpos.RelativeTransformerDecoderLayer(16, 4, 32, **kw)
    x, padding = _padded_batch()
    packed, cu = pack(x, padding)
    torch.testing.assert_close(enc(packed, cu_seqlens=cu),
                               enc(x, src_key_padding_mask=padding)[~padding], rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(4)
    memory = torch.randn(len(LENGTHS), 11, 16, generator=g, dtype=torch.float64)
    mem_lengths = [11, 4, 10, 6]
    mem_padding = torch.arange(11)[None, :] >= torch.tensor(mem_lengths)[:, None]
    mem_packed, mem_cu = pack(memory, mem_padding)
    padded = dec(x, memory, tgt_key_padding_mask=padding, memory_key_padding_mask=mem_padding,
                 tgt_is_causal=True)
    out = dec(packed, mem_packed, tgt_is_causal=True, cu_seqlens=cu, memory_cu_seqlens=mem_cu)
    torch.testing.assert_close(out, padded[~padding], rtol=0, atol=1e-12)


def test_packed_module_calls_refuse_masks_and_caches() -> None:
    mha = relpos.RelativeMultiheadAttention(8, 2, max_distance=2)
    x = torch.randn(5, 8)
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match="takes no key_padding_mask"):
        mha(x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"query must have shape \(T, F\) packed"):
        mha(x.view(1, 5, 8), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens_k was given without cu_seqlens"):
        mha(x, cu_seqlens_k=cu)
    layer = relpos.RelativeTransformerDecoderLayer(8, 2, 16, max_distance=2)
    with pytest.raises(ValueError, match="needs both cu_seqlens"):
        layer(x, x, cu_seqlens=cu)


def test_every_pair_of_sequences_is_independent() -> None:
    # Changing one sequence's tokens changes no other sequence's rows.
    x = _inputs([4, 6, 3], [4, 6, 3])
    t = _tables((2, 2), 2, 4, 3, False, "both")
    base = relative_attention_varlen(**x, max_distance=2, **t).detach()
    for s, (a, b) in enumerate(itertools.pairwise([0, 4, 10, 13])):
        changed = {k: v.detach().clone() if v.is_floating_point() else v for k, v in x.items()}
        changed["key"][a:b] += 1.0
        changed["value"][a:b] -= 1.0
        out = relative_attention_varlen(**changed, max_distance=2, **t)
        same = torch.ones(13, dtype=torch.bool)
        same[a:b] = False
        assert torch.equal(out[same], base[same]), s
        assert not torch.equal(out[~same], base[~same]), s


# ------------------------------------------------------------------------------------------
# Models


@pytest.mark.parametrize("positions", ["relative", "learned", "sinusoidal"])
def test_language_model_packed_equals_padded_on_the_real_tokens(positions: str) -> None:
    from relpos.models import ModelConfig, RelativeTransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, d_model=16, num_heads=2, num_layers=2, dim_feedforward=32,
                      max_distance=3, dropout=0.0, positions=positions, max_length=16)
    model = RelativeTransformerLM(cfg).double()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 23, (len(LENGTHS), max(LENGTHS)), generator=g)
    real = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    padded = model(ids, key_mask=real)
    packed_ids, cu = pack(ids, ~real)
    out = model(packed_ids, cu_seqlens=cu)
    assert out.shape == (sum(LENGTHS), 23)
    torch.testing.assert_close(out, padded[real], rtol=0, atol=1e-10)


def test_encoder_model_pools_each_packed_sequence() -> None:
    from relpos.models import ModelConfig, RelativeTransformerEncoderModel

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32,
                      causal=False, num_classes=3, max_distance=2, dropout=0.0)
    model = RelativeTransformerEncoderModel(cfg).double()
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 20, (len(LENGTHS), max(LENGTHS)), generator=g)
    real = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    packed_ids, cu = pack(ids, ~real)
    for pool in (None, "mean", "first"):
        padded = model(ids, key_mask=real, pool=pool)
        out = model(packed_ids, cu_seqlens=cu, pool=pool)
        want = padded[real] if pool is None else padded
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match=r"packed ids \(cu_seqlens=...\) must have shape"):
        model(ids, cu_seqlens=cu)
    with pytest.raises(ValueError, match="takes no key_mask"):
        model(packed_ids, cu_seqlens=cu, key_mask=real)


# ------------------------------------------------------------------------------------------
# torch.compile


def test_compiled_packed_call_traces_whole_and_does_not_recompile_per_batch() -> None:
    if not NATIVE:
        pytest.skip("the native kernels are not built here")
    import torch._dynamo

    graphs = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    table = torch.randn(5, 4, dtype=torch.float64)

    def f(q, k, v, cu):  # type: ignore[no-untyped-def]
        return relative_attention_varlen(q, k, v, cu, cu, max_distance=2, rel_keys=table,
                                         rel_values=table, is_causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for lengths in ([3, 5], [4, 1, 7], [2, 2, 2, 9], [6]):
        x = _inputs(lengths, lengths, D=4, Dv=4)
        q, k, v = (x[n].detach() for n in ("query", "key", "value"))
        got = compiled(q, k, v, x["cu_seqlens_q"])
        want = _definition({"query": q, "key": k, "value": v}, lengths, lengths,
                           max_distance=2, rel_keys=table, rel_values=table, is_causal=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert 1 <= len(graphs) <= 2, len(graphs)


def test_compiled_packed_call_with_seqused_k_traces_one_graph() -> None:
    if not NATIVE:
        pytest.skip("the native kernels are not built here")
    import torch._dynamo

    graphs = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    table = torch.randn(5, 4, dtype=torch.float64)

    def f(q, k, v, cu_q, cu_k, used):  # type: ignore[no-untyped-def]
        return relative_attention_varlen(q, k, v, cu_q, cu_k, max_distance=2, seqused_k=used,
                                         rel_keys=table, rel_values=table, is_causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    lengths, spare = [3, 5, 1], [2, 0, 4]
    x = _with_spare(_inputs([2, 4, 1], lengths, D=4, Dv=4), lengths, spare)
    q, k, v = (x[n].detach() for n in ("query", "key", "value"))
    for used in ([3, 5, 1], [2, 4, 1]):  # other values, one graph
        x["seqused_k"] = torch.tensor(used)
        got = compiled(q, k, v, x["cu_seqlens_q"], x["cu_seqlens_k"], x["seqused_k"])
        want = relative_attention_varlen(q, k, v, x["cu_seqlens_q"], x["cu_seqlens_k"],
                                         max_distance=2, seqused_k=x["seqused_k"],
                                         rel_keys=table, rel_values=table, is_causal=True)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(graphs) == 1, len(graphs)


@pytest.mark.parametrize("case", ["tables", "causal", "seqused_k"])
def test_compiled_call_refuses_more_queries_than_keys_as_the_eager_call_does(case: str) -> None:
    if not NATIVE:
        pytest.skip("the native kernels are not built here")
    import torch._dynamo

    x = _inputs([2, 3], [2, 2], D=4, Dv=4)  # sequence 1: 3 queries, 2 keys
    q, k, v = (x[n].detach() for n in ("query", "key", "value"))
    table = torch.randn(5, 4, dtype=torch.float64)
    kwargs: dict = dict(max_distance=2)
    if case == "tables":
        kwargs["rel_keys"] = table
    else:
        kwargs["is_causal"] = True
    cu_k = x["cu_seqlens_k"]
    if case == "seqused_k":  # regions of 2 and 4 keys, sequence 1 uses 2 of its 4
        k, v = torch.cat([k, k[:2]]), torch.cat([v, v[:2]])
        cu_k = torch.tensor([0, 2, 6])
        kwargs["seqused_k"] = torch.tensor([2, 2])
    keys = "uses 2 keys \\(seqused_k\\)" if case == "seqused_k" else "2 keys"
    match = f"sequence 1 has 3 queries but {keys}: .*need L <= S in every sequence"
    with pytest.raises(ValueError, match=match):
        relative_attention_varlen(q, k, v, x["cu_seqlens_q"], cu_k, **kwargs)

    def f(q, k, v, cu_q, cu_k):  # type: ignore[no-untyped-def]
        return relative_attention_varlen(q, k, v, cu_q, cu_k, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=match):
        compiled(q, k, v, x["cu_seqlens_q"], cu_k)
    fits = _inputs([2, 2], [2, 3], D=4, Dv=4)  # the same graph serves a call that fits
    if case != "seqused_k":
        got = compiled(*(fits[n].detach() for n in ("query", "key", "value")),
                       fits["cu_seqlens_q"], fits["cu_seqlens_k"])
        assert got.shape == (4, 2, 4) and torch.isfinite(got).all()


def test_the_fit_check_is_an_op_that_compiles() -> None:
    if not NATIVE:
        pytest.skip("the native kernels are not built here")
    from relpos.ops.native import op

    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 2, 6])
    torch.library.opcheck(torch.ops.relpos.varlen_queries_fit.default, (cu_q, cu_k, None))
    torch.library.opcheck(torch.ops.relpos.varlen_queries_fit.default,
                          (cu_q, cu_k, torch.tensor([2, 3])))
    assert torch.equal(op.varlen_queries_fit(cu_q, cu_k, None), cu_q)
    with pytest.raises(ValueError, match=r"sequence 1 has 3 queries but uses 2 keys \(seqused_k"):
        op.varlen_queries_fit(cu_q, cu_k, torch.tensor([2, 2]))
