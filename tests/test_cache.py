"""KV cache: incremental decoding equals one full pass; the decode backend; refused calls."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import KVCache, LayerCache, RelativeMultiheadAttention

F64 = torch.float64
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
BACKENDS = relpos.available_backends()


def _mha(K: int, *, share_heads: bool, keys: bool, values: bool, dtype: torch.dtype,
         implementation: str | None = None, seed: int = 0) -> RelativeMultiheadAttention:
    torch.manual_seed(seed)
    return RelativeMultiheadAttention(
        24, 3, batch_first=True, max_distance=K, relative_keys=keys, relative_values=values,
        share_heads=share_heads,
        implementation=implementation, dtype=dtype,  # type: ignore[arg-type]
    ).eval()


def _decode_in_chunks(mha: RelativeMultiheadAttention, x: torch.Tensor, sizes: list[int],
                      cache: LayerCache | None = None) -> torch.Tensor:
    cache = LayerCache() if cache is None else cache
    outs, pos = [], 0
    for size in sizes:
        out, _ = mha(x[:, pos : pos + size], need_weights=False, is_causal=True, cache=cache)
        outs.append(out)
        pos += size
    assert pos == x.shape[1] and cache.length == pos
    return torch.cat(outs, dim=1)


def _random_sizes(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sizes, left = [], n
    while left:
        s = int(torch.randint(1, min(left, 9) + 1, (1,), generator=g))
        sizes.append(s)
        left -= s
    return sizes


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize(
    "dtype, K",  # K = 40 > sequence length: no clipping
    [(F64, 0), (F64, 3), (F64, 40), (torch.float32, 3), (torch.float32, 40)],
)
@pytest.mark.parametrize("share_heads", [True, False])
@pytest.mark.parametrize("terms", [(True, True), (True, False), (False, True)])
def test_token_by_token_and_chunked_equal_full_pass(dtype, K, share_heads, terms):
    mha = _mha(K, share_heads=share_heads, keys=terms[0], values=terms[1], dtype=dtype)
    x = torch.randn(2, 17, 24, dtype=dtype)
    with torch.no_grad():
        full, _ = mha(x, need_weights=False, is_causal=True)
        one_by_one = _decode_in_chunks(mha, x, [1] * 17)
        chunked = _decode_in_chunks(mha, x, _random_sizes(17, seed=K))
        prefill_then_steps = _decode_in_chunks(mha, x, [11, 1, 1, 4])
    tol = TOL[dtype]
    torch.testing.assert_close(one_by_one, full, atol=tol, rtol=0)
    torch.testing.assert_close(chunked, full, atol=tol, rtol=0)
    torch.testing.assert_close(prefill_then_steps, full, atol=tol, rtol=0)


@pytest.mark.parametrize("implementation", BACKENDS)
@pytest.mark.parametrize("K", [2, 30])
def test_cached_decoding_with_every_backend(implementation, K):
    mha = _mha(K, share_heads=False, keys=True, values=True, dtype=F64,
               implementation=implementation)
    ref = _mha(K, share_heads=False, keys=True, values=True, dtype=F64,
               implementation="reference")
    x = torch.randn(2, 19, 24, dtype=F64)
    with torch.no_grad():
        full, _ = ref(x, need_weights=False, is_causal=True)
        chunks = [5, 1, 1, 7, 1, 4]
        got = _decode_in_chunks(mha, x, chunks)
    torch.testing.assert_close(got, full, atol=1e-10, rtol=0)


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 30),
    K=st.integers(0, 12),
    data=st.data(),
)
def test_any_chunk_schedule_equals_full_pass(n, K, data):
    cuts = data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1) if n > 1 else st.just(set()))
    bounds = [0, *sorted(cuts), n]
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    share = data.draw(st.booleans())
    mha = _mha(K, share_heads=share, keys=True, values=True, dtype=F64)
    x = torch.randn(2, n, 24, dtype=F64)
    with torch.no_grad():
        full, _ = mha(x, need_weights=False, is_causal=True)
        got = _decode_in_chunks(mha, x, sizes)
    torch.testing.assert_close(got, full, atol=1e-10, rtol=0)


def test_growable_cache_equals_preallocated_and_fixed():
    mha = _mha(4, share_heads=True, keys=True, values=True, dtype=F64)
    x = torch.randn(1, 150, 24, dtype=F64)  # grows past the default capacity twice
    with torch.no_grad():
        full, _ = mha(x, need_weights=False, is_causal=True)
        grown = _decode_in_chunks(mha, x, [1] * 150, LayerCache())
        fixed = _decode_in_chunks(mha, x, [50] * 3, LayerCache(capacity=150, growable=False))
    torch.testing.assert_close(grown, full, atol=1e-10, rtol=0)
    torch.testing.assert_close(fixed, full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_and_encoder_layers_with_cache(norm_first):
    torch.manual_seed(0)
    kw = dict(dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=norm_first,
              max_distance=3, dtype=F64, share_heads=False)
    dec = relpos.RelativeTransformerDecoderLayer(24, 3, **kw).eval()  # type: ignore[arg-type]
    enc = relpos.RelativeTransformerEncoderLayer(24, 3, **kw).eval()  # type: ignore[arg-type]
    x, mem = torch.randn(2, 13, 24, dtype=F64), torch.randn(2, 5, 24, dtype=F64)
    with torch.no_grad():
        full_dec = dec(x, mem, tgt_is_causal=True)
        full_enc = enc(x, is_causal=True)
        c1, c2 = LayerCache(), LayerCache()
        steps_dec, steps_enc, pos = [], [], 0
        for size in (4, 1, 1, 7):
            steps_dec.append(dec(x[:, pos : pos + size], mem, tgt_is_causal=True, cache=c1))
            steps_enc.append(enc(x[:, pos : pos + size], is_causal=True, cache=c2))
            pos += size
    torch.testing.assert_close(torch.cat(steps_dec, 1), full_dec, atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.cat(steps_enc, 1), full_enc, atol=1e-10, rtol=0)


def test_key_mask_stored_with_the_cache():
    """Left-padded rows decode like the unpadded sequence (relative positions ignore padding)."""
    mha = _mha(3, share_heads=True, keys=True, values=True, dtype=F64)
    x = torch.randn(2, 12, 24, dtype=F64)
    pad = 4
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[1, :pad] = False
    with torch.no_grad():
        cache = LayerCache()
        first, _ = mha(x[:, :8], need_weights=False, is_causal=True, key_mask=key_mask[:, :8],
                       cache=cache)
        rest = [mha(x[:, i : i + 1], need_weights=False, is_causal=True, cache=cache)[0]
                for i in range(8, 12)]
        got = torch.cat([first, *rest], dim=1)
        alone, _ = mha(x[1:, pad:], need_weights=False, is_causal=True)  # row 1 without its padding
        full_row0, _ = mha(x[:1], need_weights=False, is_causal=True)
    assert cache.key_mask is not None and cache.key_mask.shape == (2, 12)
    assert torch.equal(cache.key_mask, key_mask)
    torch.testing.assert_close(got[1:, pad:], alone, atol=1e-10, rtol=0)
    torch.testing.assert_close(got[:1], full_row0, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------- decode backend










# ----------------------------------------------------------------------------- cache object
def test_memory_grows_linearly():
    cache = LayerCache()
    B, H, D = 2, 3, 4
    per_position = 2 * B * H * D * 4  # keys + values, float32
    for n in range(1, 400):
        cache.append(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        assert cache.length == n
        assert n <= cache.capacity <= max(64, 2 * n)
        assert cache.nbytes() == cache.capacity * per_position
    fixed = LayerCache(capacity=100, growable=False)
    fixed.append(torch.randn(B, H, 30, D), torch.randn(B, H, 30, D))
    assert fixed.capacity == 100 and fixed.nbytes() == 100 * per_position


def test_reset_truncate_and_kvcache_layers():
    cache = KVCache(3, capacity=8)
    assert len(cache) == 3 and cache.length == 0
    for layer in cache:
        layer.append(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    assert cache.length == 5 and cache.batch_size == 1
    cache.truncate(2)
    assert all(layer.length == 2 for layer in cache)
    assert cache[0].keys is not None and cache[0].keys.shape == (1, 2, 2, 4)
    cache.reset()
    assert cache.length == 0 and cache[1].keys is None and cache.nbytes() == 0
    cache[0].append(torch.randn(3, 1, 1, 2), torch.randn(3, 1, 1, 5))  # new shapes after reset
    assert cache[0].values.shape == (3, 1, 1, 5)  # type: ignore[union-attr]


def test_beam_reorder_equals_decoding_the_reordered_batch():
    mha = _mha(3, share_heads=False, keys=True, values=True, dtype=F64)
    x = torch.randn(3, 10, 24, dtype=F64)
    beams = torch.tensor([2, 0, 0, 1])
    cont = torch.randn(4, 5, 24, dtype=F64)  # different continuations per beam
    with torch.no_grad():
        cache = KVCache(1)
        mha(x, need_weights=False, is_causal=True, cache=cache[0])
        cache.reorder(beams)
        assert cache.batch_size == 4
        steps = [mha(cont[:, i : i + 1], need_weights=False, is_causal=True, cache=cache[0])[0]
                 for i in range(5)]
        got = torch.cat(steps, dim=1)
        scratch, _ = mha(torch.cat([x[beams], cont], dim=1), need_weights=False, is_causal=True)
    torch.testing.assert_close(got, scratch[:, 10:], atol=1e-10, rtol=0)


def _snapshot(cache: LayerCache) -> tuple:
    k, v, m = cache.keys, cache.values, cache.key_mask
    return (cache.length, cache.capacity, None if k is None else k.clone(),
            None if v is None else v.clone(), None if m is None else m.clone())


def _assert_same(cache: LayerCache, snap: tuple) -> None:
    now = _snapshot(cache)
    assert now[:2] == snap[:2]
    for a, b in zip(now[2:], snap[2:], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (lambda: (torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)), ValueError, "capacity of 8"),
        (lambda: (torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)), ValueError, "batch size"),
        (lambda: (torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)), ValueError, "heads"),
        (lambda: (torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 4)), ValueError, "key head dim"),
        (lambda: (torch.randn(2, 3, 1, 4, dtype=F64),) * 2, TypeError, "dtype"),
        (lambda: (torch.randn(2, 3, 1, 4), torch.randn(2, 3, 2, 4)), ValueError, "disagree"),
        (lambda: (torch.randn(2, 3, 0, 4), torch.randn(2, 3, 0, 4)), ValueError, "t >= 1"),
        (lambda: (torch.randn(3, 1, 4), torch.randn(3, 1, 4)), ValueError, "4-D"),
        (lambda: (torch.ones(2, 3, 1, 4, dtype=torch.long),) * 2, TypeError, "floating"),
    ],
)
def test_refused_append_leaves_cache_unchanged(bad, error, match):
    cache = LayerCache(capacity=8, growable=False)
    cache.append(torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4),
                 torch.tensor([[True] * 3, [False, True, True]]))
    snap = _snapshot(cache)
    with pytest.raises(error, match=match):
        cache.append(*bad())
    _assert_same(cache, snap)
    with pytest.raises(ValueError, match=r"key_mask of an append must have shape"):
        cache.append(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), torch.ones(2, 2).bool())
    with pytest.raises(TypeError, match="bool"):
        cache.append(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), torch.ones(2, 1))
    _assert_same(cache, snap)


def test_refused_reorder_and_truncate_leave_cache_unchanged():
    cache = KVCache(2)
    for layer in cache:
        layer.append(torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4))
    snaps = [_snapshot(layer) for layer in cache]
    with pytest.raises(IndexError, match=r"contains 3, allowed: 0 <= index < batch size 3"):
        cache.reorder(torch.tensor([0, 3]))
    with pytest.raises(IndexError, match="-1"):
        cache.reorder([0, -1])
    with pytest.raises(TypeError, match="integer"):
        cache.reorder(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="1-D"):
        cache.reorder(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="empty"):
        KVCache(1).reorder([0])
    for layer, snap in zip(cache, snaps, strict=True):
        _assert_same(layer, snap)


def test_refused_module_step_leaves_cache_unchanged():
    mha = _mha(2, share_heads=True, keys=True, values=True, dtype=F64)
    cache = LayerCache()
    with torch.no_grad():
        mha(torch.randn(2, 5, 24, dtype=F64), need_weights=False, is_causal=True, cache=cache)
        snap = _snapshot(cache)
        # A float attn_mask of another dtype, refused after the append:
        with pytest.raises(TypeError, match=r"float attn_mask has dtype torch\.float32"):
            mha(torch.randn(2, 2, 24, dtype=F64), attn_mask=torch.zeros(2, 7), cache=cache)
        with pytest.raises(ValueError, match=r"attn_mask must have shape \(L, S\) = \(2, 7\)"):
            mha(torch.randn(2, 2, 24, dtype=F64), attn_mask=torch.ones(3, 3, dtype=torch.bool),
                cache=cache)
        _assert_same(cache, snap)
        with pytest.raises(ValueError, match="self-attention"):
            mha(torch.randn(2, 1, 24, dtype=F64), torch.randn(2, 1, 24, dtype=F64), cache=cache)
        with pytest.raises(TypeError, match="LayerCache"):
            mha(torch.randn(2, 1, 24, dtype=F64), cache=KVCache(1))  # type: ignore[arg-type]
        _assert_same(cache, snap)
        fresh = LayerCache()
        with pytest.raises(TypeError, match="float attn_mask has dtype"):
            mha(torch.randn(2, 2, 24, dtype=F64), attn_mask=torch.zeros(2, 2), cache=fresh)
        assert fresh.keys is None and fresh.length == 0


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="capacity"):
        LayerCache(growable=False)
    with pytest.raises(ValueError, match="positive"):
        LayerCache(capacity=0)
    with pytest.raises(TypeError, match="capacity"):
        LayerCache(capacity=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_layers"):
        KVCache(0)
    with pytest.raises(TypeError, match="growable"):
        KVCache(1, growable=1)  # type: ignore[arg-type]




# ----------------------------------------------------------------------------- rollback
def _rollback_kv(B: int = 2, t: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, 2, t, 4), torch.randn(B, 2, t, 4)


def test_layer_rollback_truncates_a_filled_cache_and_forgets_a_fresh_one():
    cache = LayerCache()
    cache.append(*_rollback_kv())
    keys = cache.keys.clone()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="refused"), cache.rollback_on_error():
        cache.append(*_rollback_kv(t=2))
        assert cache.length == 5
        raise RuntimeError("refused")
    assert cache.length == 3 and torch.equal(cache.keys, keys)  # type: ignore[arg-type]
    fresh = LayerCache()
    with pytest.raises(RuntimeError), fresh.rollback_on_error():
        fresh.append(*_rollback_kv(B=3))
        raise RuntimeError("refused")
    assert fresh.keys is None and fresh.batch_size is None
    fresh.append(*_rollback_kv(B=5))  # the failed step fixed no shapes


def test_layer_rollback_keeps_a_successful_step():
    cache = LayerCache()
    with cache.rollback_on_error() as same:
        assert same is cache
        cache.append(*_rollback_kv())
    assert cache.length == 3


def test_kv_cache_rollback_undoes_every_layer_of_a_partial_step():
    cache = KVCache(3)
    for layer in cache:
        layer.append(*_rollback_kv())
    with pytest.raises(ValueError, match="mid-step"), cache.rollback_on_error():
        cache[0].append(*_rollback_kv(t=1))
        cache[1].append(*_rollback_kv(t=1))  # layer 2 never gets there
        raise ValueError("mid-step")
    assert [layer.length for layer in cache] == [3, 3, 3]
    empty = KVCache(2)
    with pytest.raises(ValueError), empty.rollback_on_error():
        empty[0].append(*_rollback_kv())
        raise ValueError("mid-step")
    assert all(layer.keys is None for layer in empty)


def test_version_counts_every_change_and_no_refused_call():
    cache = LayerCache(capacity=2, growable=True)
    seen = [cache.version]

    def changed() -> None:
        assert cache.version != seen[-1]
        seen.append(cache.version)

    x = torch.randn(1, 2, 2, 4)
    cache.append(x, x)
    changed()
    cache.reserve_step(1, 2, 4)  # grows 2 -> 4
    changed()
    cache.advance(1)
    changed()
    cache.truncate(2)
    changed()
    cache.reorder([0, 0])
    changed()
    with pytest.raises(ValueError):
        cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))  # batch size 1 != 2
    assert cache.version == seen[-1]
    cache.reset()
    changed()
    # unique across caches: two caches with the same history never share a version
    a, b = LayerCache(), LayerCache()
    for c in (a, b):
        c.append(x, x)
    assert a.version != b.version
