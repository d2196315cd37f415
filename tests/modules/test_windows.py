"""Windows ``max_distance=(left, right)`` through the modules: tables of ``left + right + 1``
rows, outputs and gradients against a dense float64 reference at awkward windows (one side 0,
both 0, w2v-BERT's (64, 8), one side wider than the sequence), configs, reprs, size checks and
KV-cache steps (token by token and chunked equal one full causal pass)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import relpos
from relpos import (
    LayerCache,
    RelativeMultiheadAttention,
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)
from relpos.modules._checks import MAX_TABLE_ELEMENTS

F64 = torch.float64
WINDOWS = [(0, 0), (0, 5), (5, 0), (3, 1), (64, 8), (2, 40)]
E, H = 12, 3


def _mha(window, *, seed=0, **kwargs):
    torch.manual_seed(seed)
    return RelativeMultiheadAttention(E, H, batch_first=True, max_distance=window, dtype=F64,
                                      **kwargs)


def _dense(mha: RelativeMultiheadAttention, x: torch.Tensor, *, causal: bool,
           key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The module's math written out densely: projections, per-pair table rows, softmax."""
    left, right = mha.window
    B, L, _ = x.shape
    D = E // H
    q, k, v = nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
    offset = torch.arange(L)[None, :] - torch.arange(L)[:, None]  # j - i
    row = offset.clamp(-left, right) + left  # (L, L)

    def per_pair(table):
        if table is None:
            return torch.zeros(H, L, L, D, dtype=F64)
        t = table if table.dim() == 3 else table.expand(H, *table.shape)
        return t[:, row]  # (H, L, L, D)

    ak, av = per_pair(mha.rel_keys), per_pair(mha.rel_values)
    scores = (q @ k.transpose(-1, -2) + torch.einsum("bhid,hijd->bhij", q, ak)) / math.sqrt(D)
    visible = torch.ones(B, 1, L, L, dtype=torch.bool)
    if causal:
        visible = visible & (offset <= 0)
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    out = p @ v + torch.einsum("bhij,hijd->bhid", p, av)  # (B, H, L, D)
    return mha.out_proj(out.transpose(1, 2).reshape(B, L, E))


# --- tables, config, repr ---------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("share_heads", [True, False])
def test_tables_have_left_plus_right_plus_one_rows(window, share_heads):
    mha = _mha(window, share_heads=share_heads)
    rows = window[0] + window[1] + 1
    want = (rows, E // H) if share_heads else (H, rows, E // H)
    assert mha.rel_keys is not None and mha.rel_values is not None
    assert mha.rel_keys.shape == want and mha.rel_values.shape == want
    assert mha.max_distance == window and mha.window == window


def test_int_stays_an_int_and_a_list_becomes_a_tuple():
    sym = _mha(4)
    assert sym.max_distance == 4 and type(sym.max_distance) is int and sym.window == (4, 4)
    assert sym.get_config()["max_distance"] == 4
    assert "max_distance=4," in repr(sym)
    listed = _mha([5, 2])
    assert listed.max_distance == (5, 2) and isinstance(listed.max_distance, tuple)
    assert "max_distance=(5, 2)" in repr(listed)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (RelativeMultiheadAttention, dict(embed_dim=12, num_heads=3, max_distance=(5, 2),
                                          share_heads=False)),
        (RelativeTransformerEncoderLayer, dict(d_model=12, nhead=3, dim_feedforward=20,
                                               max_distance=(0, 3), batch_first=True)),
        (RelativeTransformerDecoderLayer, dict(d_model=12, nhead=2, dim_feedforward=24,
                                               max_distance=(64, 8),
                                               relative_cross_attention=True)),
    ],
)
def test_get_config_round_trips_the_window(cls, kwargs):
    module = cls(**kwargs)
    config = module.get_config()
    assert config["max_distance"] == kwargs["max_distance"]
    twin = cls(**config)
    assert twin.get_config() == config
    assert {k: v.shape for k, v in twin.state_dict().items()} == {
        k: v.shape for k, v in module.state_dict().items()
    }
    assert f"max_distance={kwargs['max_distance']}" in repr(module)
    twin.load_state_dict(module.state_dict())  # same window: loads


def test_layers_give_their_window_to_every_relative_attention():
    dec = RelativeTransformerDecoderLayer(12, 2, 24, max_distance=(4, 1),
                                          relative_cross_attention=True)
    assert dec.self_attn.window == dec.multihead_attn.window == (4, 1)
    assert dec.multihead_attn.rel_keys is not None
    assert dec.multihead_attn.rel_keys.shape == (6, 6)


@pytest.mark.parametrize(("window", "error", "fragment"), [
    ((1, 2, 3), ValueError, "3 values"),
    ((-1, 2), ValueError, r"max_distance\[0\] \(left\)"),
    ((1, -2), ValueError, r"max_distance\[1\] \(right\)"),
    ((1, 2.5), TypeError, "right"),
    ((True, 2), TypeError, "left"),
    ("(1, 2)", TypeError, "pair"),
])
def test_bad_windows_are_refused_by_every_module(window, error, fragment):
    for make in (lambda: RelativeMultiheadAttention(8, 2, max_distance=window),
                 lambda: RelativeTransformerEncoderLayer(8, 2, 16, max_distance=window),
                 lambda: RelativeTransformerDecoderLayer(8, 2, 16, max_distance=window)):
        with pytest.raises(error, match=fragment):
            make()


def test_table_size_limit_counts_both_sides():
    D = 4  # columns per row of a shared table of RelativeMultiheadAttention(8, 2)
    rows = MAX_TABLE_ELEMENTS // D
    ok = RelativeMultiheadAttention(8, 2, max_distance=(rows - 1 - 7, 7), device="meta",
                                    relative_values=False)
    assert ok.rel_keys is not None and ok.rel_keys.shape == (rows, D)
    for window in ((rows - 7, 7), (0, rows), (rows, 0)):
        with pytest.raises(ValueError, match=rf"left \+ right <= {rows - 1} for this module"):
            RelativeMultiheadAttention(8, 2, max_distance=window, device="meta")
    # Without tables any window is served (nothing is allocated).
    plain = RelativeMultiheadAttention(8, 2, max_distance=(10**9, 3), relative_keys=False,
                                       relative_values=False)
    out, _ = plain(torch.randn(5, 2, 8), need_weights=False)
    assert out.shape == (5, 2, 8)


# --- numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_dense_reference(window, causal):
    for (share_heads, (keys, values)), implementation in itertools.product(
            itertools.product((True, False), ((True, True), (True, False), (False, True))),
            (None, "reference", "bucketed", "flash_regions", "native")):
        mha = _mha(window, share_heads=share_heads, relative_keys=keys, relative_values=values,
                   implementation=implementation)
        x = torch.randn(2, 9, E, dtype=F64, generator=torch.Generator().manual_seed(1))
        key_mask = torch.ones(2, 9, dtype=torch.bool)
        key_mask[1, :3] = False
        want = _dense(mha, x, causal=causal, key_mask=key_mask)
        got, _ = mha(x, need_weights=False, is_causal=causal, key_mask=key_mask)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        with_weights, weights = mha(x, is_causal=causal, key_mask=key_mask)
        torch.testing.assert_close(with_weights, want, rtol=0, atol=1e-10)
        assert weights is not None and weights.shape == (2, 9, 9)


@pytest.mark.parametrize("window", [(0, 5), (5, 0), (64, 8), (0, 0)])
def test_gradients_match_dense_reference(window):
    for implementation in ("bucketed", "flash_regions", "native"):
        mha = _mha(window, share_heads=False, implementation=implementation)
        x = torch.randn(2, 11, E, dtype=F64, requires_grad=True)
        up = torch.randn(2, 11, E, dtype=F64)
        params = [x, *mha.parameters()]
        got = torch.autograd.grad(mha(x, need_weights=False, is_causal=True)[0], params, up)
        want = torch.autograd.grad(_dense(mha, x, causal=True), params, up)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_symmetric_window_equals_the_clip_distance():
    as_int, as_pair = _mha(3), _mha((3, 3))
    as_pair.load_state_dict(as_int.state_dict())  # the same window: loads either way
    as_int.load_state_dict(as_pair.state_dict())
    x = torch.randn(2, 10, E, dtype=F64)
    torch.testing.assert_close(as_pair(x)[0], as_int(x)[0], rtol=0, atol=0)


def test_one_side_wider_than_the_sequence_clips_nothing_on_that_side():
    wide, narrow = _mha((50, 2)), _mha((7, 2))
    assert wide.rel_keys is not None and wide.rel_values is not None
    with torch.no_grad():  # narrow gets the rows of offsets -7..+2 of the wide tables
        narrow.rel_keys.copy_(wide.rel_keys[43:])  # type: ignore[union-attr]
        narrow.rel_values.copy_(wide.rel_values[43:])  # type: ignore[union-attr]
        for name in ("in_proj_weight", "in_proj_bias"):
            getattr(narrow, name).copy_(getattr(wide, name))
        narrow.out_proj.load_state_dict(wide.out_proj.state_dict())
    x = torch.randn(2, 8, E, dtype=F64)  # offsets reach -7 at most
    for causal in (False, True):
        torch.testing.assert_close(wide(x, is_causal=causal)[0], narrow(x, is_causal=causal)[0],
                                   rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [(5, 2), (3, 0), (0, 4), (64, 8)])
def test_encoder_and_decoder_layers_match_reference_backend(window):
    torch.manual_seed(0)
    enc = RelativeTransformerEncoderLayer(12, 3, 24, dropout=0.0, batch_first=True,
                                          max_distance=window, dtype=F64)
    ref = RelativeTransformerEncoderLayer(**{**enc.get_config(), "implementation": "reference"},
                                          dtype=F64)
    ref.load_state_dict(enc.state_dict())
    x = torch.randn(2, 10, 12, dtype=F64)
    for causal in (False, True):
        torch.testing.assert_close(enc(x, is_causal=causal), ref(x, is_causal=causal),
                                   rtol=0, atol=1e-10)
    dec = RelativeTransformerDecoderLayer(12, 3, 24, dropout=0.0, batch_first=True,
                                          max_distance=window, relative_cross_attention=True,
                                          dtype=F64)
    dref = RelativeTransformerDecoderLayer(
        **{**dec.get_config(), "implementation": "reference"}, dtype=F64)
    dref.load_state_dict(dec.state_dict())
    memory = torch.randn(2, 13, 12, dtype=F64)
    torch.testing.assert_close(dec(x, memory, tgt_is_causal=True),
                               dref(x, memory, tgt_is_causal=True), rtol=0, atol=1e-10)


# --- KV cache ---------------------------------------------------------------------------


def _decode_in_chunks(module, x, sizes, *, layer=False):
    cache = LayerCache()
    outs, pos = [], 0
    for size in sizes:
        step = x[:, pos : pos + size]
        if layer:
            outs.append(module(step, is_causal=True, cache=cache))
        else:
            outs.append(module(step, need_weights=False, is_causal=True, cache=cache)[0])
        pos += size
    assert cache.length == x.shape[1]
    return torch.cat(outs, dim=1)


SCHEDULES = ([1] * 17, [3, 5, 1, 8], [11, 1, 1, 4], [2, 2, 2, 2, 2, 2, 2, 3])


@pytest.mark.parametrize("window", [(5, 2), (3, 0), (0, 4), (0, 0), (64, 8)])
@pytest.mark.parametrize("implementation", [None, *relpos.available_backends()])
def test_cached_steps_equal_one_full_causal_pass(window, implementation):
    for share_heads in (True, False):
        mha = _mha(window, share_heads=share_heads, implementation=implementation).eval()
        x = torch.randn(2, 17, E, dtype=F64)
        with torch.no_grad():
            full, _ = mha(x, need_weights=False, is_causal=True)
            torch.testing.assert_close(full, _dense(mha, x, causal=True), rtol=0, atol=1e-10)
            for sizes in SCHEDULES:
                got = _decode_in_chunks(mha, x, sizes)
                torch.testing.assert_close(got, full, rtol=0, atol=1e-10, msg=str(sizes))


@pytest.mark.parametrize("window", [(5, 2), (3, 0)])
def test_cached_layer_steps_with_padding_equal_one_full_pass(window):
    torch.manual_seed(0)
    layer = RelativeTransformerEncoderLayer(12, 3, 24, dropout=0.0, batch_first=True,
                                            norm_first=True, max_distance=window,
                                            dtype=F64).eval()
    x = torch.randn(2, 13, 12, dtype=F64)
    key_mask = torch.ones(2, 13, dtype=torch.bool)
    key_mask[0, :4] = False  # left padding in the first row
    with torch.no_grad():
        full = layer(x, is_causal=True, key_mask=key_mask)
        for sizes in ([1] * 13, [6, 1, 4, 2]):
            cache, outs, pos = LayerCache(), [], 0
            for size in sizes:
                outs.append(layer(x[:, pos : pos + size], is_causal=True, cache=cache,
                                  key_mask=key_mask[:, pos : pos + size]))
                pos += size
            got = torch.cat(outs, dim=1)
            torch.testing.assert_close(got[0, 4:], full[0, 4:], rtol=0, atol=1e-10)
            torch.testing.assert_close(got[1], full[1], rtol=0, atol=1e-10)
