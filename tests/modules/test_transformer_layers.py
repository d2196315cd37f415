"""The relative Transformer layers: inside torch.nn's containers, and their masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import F64, manual_mha
from relpos import (
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)


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
        a = manual_mha(lyr.self_attn, h, key_mask=~pad, is_causal=True)
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


def test_encoder_layer_key_mask_equals_padding_mask_and_refuses_both():
    torch.manual_seed(8)
    layer = RelativeTransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                            max_distance=2, dtype=F64)
    x = torch.randn(3, 6, 8, dtype=F64)
    key_mask = torch.ones(3, 6, dtype=torch.bool)
    key_mask[1, 4:] = False  # relpos meaning: True = real token
    want = layer(x, src_key_padding_mask=~key_mask, is_causal=True)
    torch.testing.assert_close(layer(x, key_mask=key_mask, is_causal=True), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"both src_key_padding_mask .* and key_mask"):
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
