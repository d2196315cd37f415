"""RelativeMultiheadAttention and the Transformer layers."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relpos
from relpos import (
    RelativeMultiheadAttention,
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)

F64 = torch.float64


def _manual_mha(mha: RelativeMultiheadAttention, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """The module's math written out: projections, heads, reference attention, output."""
    B, L, E = x.shape
    H, D = mha.num_heads, mha.head_dim

    def heads(t):
        return t.view(B, L, H, D).transpose(1, 2)

    out = relpos.relative_attention(
        heads(mha.q_proj(x)), heads(mha.k_proj(x)), heads(mha.v_proj(x)),
        max_distance=mha.max_distance, rel_keys=mha.rel_keys, rel_values=mha.rel_values,
        implementation="reference", **kwargs,
    )
    return mha.out_proj(out.transpose(1, 2).reshape(B, L, E))


@pytest.mark.parametrize("share_heads", [True, False])
@pytest.mark.parametrize("is_causal", [False, True])
def test_mha_matches_manual_math(share_heads, is_causal):
    torch.manual_seed(0)
    mha = RelativeMultiheadAttention(12, 3, 2, share_heads=share_heads, dtype=F64)
    x = torch.randn(2, 7, 12, dtype=F64)
    out, weights = mha(x, is_causal=is_causal)
    assert weights is None
    torch.testing.assert_close(out, _manual_mha(mha, x, is_causal=is_causal))
    expected_table = (5, 4) if share_heads else (3, 5, 4)
    assert mha.rel_keys.shape == expected_table and mha.rel_values.shape == expected_table


def test_mha_need_weights_and_masks():
    torch.manual_seed(1)
    mha = RelativeMultiheadAttention(8, 2, 3, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out, weights = mha(x, key_mask=key_mask, need_weights=True)
    assert weights.shape == (2, 2, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5, dtype=F64))
    assert torch.all(weights[1, :, :, 3:] == 0)
    torch.testing.assert_close(out, _manual_mha(mha, x, key_mask=key_mask))
    out2, _ = mha(x, key_mask=key_mask)
    torch.testing.assert_close(out, out2)


def test_mha_cross_attention_kdim_vdim_and_seq_first():
    torch.manual_seed(2)
    mha = RelativeMultiheadAttention(8, 2, 1, kdim=5, vdim=3, batch_first=False)
    q = torch.randn(4, 2, 8)
    k = torch.randn(6, 2, 5)
    v = torch.randn(6, 2, 3)
    out, _ = mha(q, k, v)
    assert out.shape == (4, 2, 8)


def test_mha_relative_terms_change_output():
    torch.manual_seed(3)
    mha = RelativeMultiheadAttention(8, 2, 2)
    x = torch.randn(1, 6, 8)
    with_rel, _ = mha(x)
    with torch.no_grad():
        mha.rel_keys.zero_()
        mha.rel_values.zero_()
    without, _ = mha(x)
    assert not torch.allclose(with_rel, without)


def test_state_dict_round_trip():
    torch.manual_seed(4)
    a = RelativeMultiheadAttention(8, 2, 3, share_heads=False)
    b = RelativeMultiheadAttention(8, 2, 3, share_heads=False)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.load_state_dict(torch.load(buffer))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(a(x)[0], b(x)[0], atol=0, rtol=0)


def test_dtype_device_kwargs_and_repr():
    mha = RelativeMultiheadAttention(8, 2, 5, dtype=F64, device="cpu", relative_values=False)
    assert all(p.dtype == F64 for p in mha.parameters())
    assert mha.rel_values is None and mha.rel_keys.shape == (11, 4)
    assert "max_distance=5" in repr(mha) and "relative_values=False" in repr(mha)
    layer = RelativeTransformerEncoderLayer(8, 2, 16, dtype=F64, max_distance=3)
    assert all(p.dtype == F64 for p in layer.parameters())
    assert "max_distance=3" in repr(layer)


def test_encoder_layer_inside_transformer_encoder_matches_manual():
    torch.manual_seed(5)
    layer = RelativeTransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                            max_distance=2, dtype=F64)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(3, 6, 8, dtype=F64)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True  # PyTorch meaning: True = padding
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
    out = encoder(x, mask=causal, src_key_padding_mask=pad.to(F64).masked_fill(pad, -torch.inf))
    # Manual: relpos meanings, key_mask True = real token, causal flag.
    h = x
    for lyr in encoder.layers:
        a = _manual_mha(lyr.self_attn, h, key_mask=~pad, is_causal=True)
        h = lyr.norm1(h + a)
        h = lyr.norm2(h + lyr.linear2(F.relu(lyr.linear1(h))))
    torch.testing.assert_close(out, h)


def test_encoder_layer_bool_masks_use_pytorch_meaning():
    torch.manual_seed(6)
    layer = RelativeTransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                            max_distance=2, norm_first=True, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64)
    torch_mask = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = not allowed
    a = layer(x, src_mask=torch_mask)
    b = layer(x, is_causal=True)
    torch.testing.assert_close(a, b)


def test_decoder_layer_inside_transformer_decoder():
    torch.manual_seed(7)
    layer = RelativeTransformerDecoderLayer(8, 2, 16, dropout=0.0, max_distance=3)
    decoder = nn.TransformerDecoder(layer, num_layers=2)
    tgt = torch.randn(5, 2, 8)
    memory = torch.randn(7, 2, 8)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    out = decoder(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
    assert out.shape == (5, 2, 8)
    # Causality: changing a later target token does not change earlier outputs.
    tgt2 = tgt.clone()
    tgt2[4] += 1.0
    out2 = decoder(tgt2, memory, tgt_mask=mask, tgt_is_causal=True)
    torch.testing.assert_close(out[:4], out2[:4])
    assert not torch.allclose(out[4], out2[4])
    # Cross-attention is plain unless asked: no tables there.
    assert layer.multihead_attn.rel_keys is None and layer.multihead_attn.rel_values is None
    rel_cross = RelativeTransformerDecoderLayer(8, 2, 16, max_distance=3,
                                                relative_cross_attention=True)
    assert rel_cross.multihead_attn.rel_keys is not None


def test_module_backward_reaches_tables():
    mha = RelativeMultiheadAttention(8, 2, 2)
    out, _ = mha(torch.randn(2, 6, 8), is_causal=True)
    out.square().sum().backward()
    assert mha.rel_keys.grad is not None and mha.rel_keys.grad.abs().sum() > 0
    assert mha.rel_values.grad is not None and mha.rel_values.grad.abs().sum() > 0


# --- relpos's key_mask straight into the layers ------------------------------------------


def test_encoder_layer_key_mask_equals_padding_mask_and_refuses_both():
    torch.manual_seed(8)
    layer = RelativeTransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                            max_distance=2, dtype=F64)
    x = torch.randn(3, 6, 8, dtype=F64)
    key_mask = torch.ones(3, 6, dtype=torch.bool)
    key_mask[1, 4:] = False  # relpos meaning: True = real token
    want = layer(x, src_key_padding_mask=~key_mask, is_causal=True)
    torch.testing.assert_close(layer(x, key_mask=key_mask, is_causal=True), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"both a key padding mask .* and key_mask"):
        layer(x, src_key_padding_mask=~key_mask, key_mask=key_mask)
    with pytest.raises(TypeError, match=r"key_mask must be a torch\.Tensor or None, got list"):
        layer(x, key_mask=[[True] * 6] * 3)


def test_decoder_layer_key_masks_equal_padding_masks():
    torch.manual_seed(9)
    layer = RelativeTransformerDecoderLayer(8, 2, 16, dropout=0.0, max_distance=2,
                                            relative_cross_attention=True, dtype=F64)
    tgt, memory = torch.randn(5, 2, 8, dtype=F64), torch.randn(7, 2, 8, dtype=F64)
    tgt_real = torch.ones(2, 5, dtype=torch.bool)
    tgt_real[0, :2] = False
    mem_real = torch.ones(2, 7, dtype=torch.bool)
    mem_real[1, 5:] = False
    want = layer(tgt, memory, tgt_key_padding_mask=~tgt_real,
                 memory_key_padding_mask=~mem_real, tgt_is_causal=True)
    got = layer(tgt, memory, key_mask=tgt_real, memory_key_mask=mem_real, tgt_is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="allowed: one of them"):
        layer(tgt, memory, memory_key_padding_mask=~mem_real, memory_key_mask=mem_real)


# --- get_config: the constructor arguments that rebuild a module -------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (RelativeMultiheadAttention, dict(embed_dim=12, num_heads=3, max_distance=2,
                                          relative_values=False, share_heads=False,
                                          dropout=0.1, bias=False, kdim=5, vdim=7,
                                          batch_first=False, implementation="bucketed")),
        (RelativeTransformerEncoderLayer, dict(d_model=12, nhead=3, dim_feedforward=20,
                                               dropout=0.2, activation="gelu",
                                               layer_norm_eps=1e-6, batch_first=True,
                                               norm_first=True, bias=False, max_distance=4,
                                               relative_keys=False, share_heads=False,
                                               implementation="reference")),
        (RelativeTransformerDecoderLayer, dict(d_model=12, nhead=2, dim_feedforward=24,
                                               max_distance=1, relative_cross_attention=True)),
        (RelativeTransformerDecoderLayer, dict(d_model=12, nhead=2, max_distance=3)),
    ],
)
def test_get_config_rebuilds_the_module(cls, kwargs):
    module = cls(**kwargs)
    config = module.get_config()
    for name, value in kwargs.items():
        assert config[name] == value, name
    twin = cls(**config)
    assert twin.get_config() == config
    assert {k: v.shape for k, v in twin.state_dict().items()} == {
        k: v.shape for k, v in module.state_dict().items()
    }
    assert "device" not in config and "dtype" not in config


def test_get_config_defaults_and_custom_activation():
    layer = RelativeTransformerEncoderLayer(8, 2)  # default activation F.relu
    assert layer.get_config()["activation"] == "relu"
    assert RelativeTransformerDecoderLayer(8, 2).get_config()["relative_cross_attention"] is False
    with pytest.raises(ValueError, match=r"custom activation .*allowed: 'relu' or 'gelu'"):
        RelativeTransformerEncoderLayer(8, 2, activation=torch.tanh).get_config()
