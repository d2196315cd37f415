"""RelativeMultiheadAttention: the module's math, masks, weights, state, bad input."""

from __future__ import annotations

import io

import pytest
import torch

from helpers import F64, manual_mha
from relpos import (
    RelativeMultiheadAttention,
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)


@pytest.mark.parametrize("share_heads", [True, False])
@pytest.mark.parametrize("is_causal", [False, True])
def test_mha_matches_manual_math(share_heads, is_causal):
    torch.manual_seed(0)
    mha = RelativeMultiheadAttention(12, 3, batch_first=True, max_distance=2,
                                     share_heads=share_heads, dtype=F64)
    x = torch.randn(2, 7, 12, dtype=F64)
    out, weights = mha(x, need_weights=False, is_causal=is_causal)
    assert weights is None
    torch.testing.assert_close(out, manual_mha(mha, x, is_causal=is_causal))
    expected_table = (5, 4) if share_heads else (3, 5, 4)
    assert mha.rel_keys.shape == expected_table and mha.rel_values.shape == expected_table


def test_mha_need_weights_and_masks():
    torch.manual_seed(1)
    mha = RelativeMultiheadAttention(8, 2, batch_first=True, max_distance=3, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out, weights = mha(x, key_mask=key_mask, average_attn_weights=False)
    assert weights.shape == (2, 2, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5, dtype=F64))
    torch.testing.assert_close(mha(x, key_mask=key_mask)[1], weights.mean(1))
    assert torch.all(weights[1, :, :, 3:] == 0)
    torch.testing.assert_close(out, manual_mha(mha, x, key_mask=key_mask))
    out2, _ = mha(x, key_mask=key_mask, need_weights=False)
    torch.testing.assert_close(out, out2)


def test_mha_cross_attention_kdim_vdim_and_seq_first():
    torch.manual_seed(2)
    mha = RelativeMultiheadAttention(8, 2, kdim=5, vdim=3, max_distance=1)
    q = torch.randn(4, 2, 8)
    k = torch.randn(6, 2, 5)
    v = torch.randn(6, 2, 3)
    out, _ = mha(q, k, v)
    assert out.shape == (4, 2, 8)


def test_mha_relative_terms_change_output():
    torch.manual_seed(3)
    mha = RelativeMultiheadAttention(8, 2, batch_first=True, max_distance=2)
    x = torch.randn(1, 6, 8)
    with_rel, _ = mha(x)
    with torch.no_grad():
        mha.rel_keys.zero_()
        mha.rel_values.zero_()
    without, _ = mha(x)
    assert not torch.allclose(with_rel, without)


def test_state_dict_round_trip():
    torch.manual_seed(4)
    a = RelativeMultiheadAttention(8, 2, max_distance=3, share_heads=False)
    b = RelativeMultiheadAttention(8, 2, max_distance=3, share_heads=False)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.load_state_dict(torch.load(buffer))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(a(x)[0], b(x)[0], atol=0, rtol=0)


def test_dtype_device_kwargs_and_repr():
    mha = RelativeMultiheadAttention(8, 2, max_distance=5, dtype=F64, device="cpu",
                                     relative_values=False)
    assert all(p.dtype == F64 for p in mha.parameters())
    assert mha.rel_values is None and mha.rel_keys.shape == (11, 4)
    assert "max_distance=5" in repr(mha) and "relative_values=False" in repr(mha)
    layer = RelativeTransformerEncoderLayer(8, 2, 16, dtype=F64, max_distance=3)
    assert all(p.dtype == F64 for p in layer.parameters())
    assert "max_distance=3" in repr(layer)


def test_module_backward_reaches_tables():
    mha = RelativeMultiheadAttention(8, 2, max_distance=2)
    out, _ = mha(torch.randn(6, 2, 8), is_causal=True)
    out.square().sum().backward()
    assert mha.rel_keys.grad is not None and mha.rel_keys.grad.abs().sum() > 0
    assert mha.rel_values.grad is not None and mha.rel_values.grad.abs().sum() > 0




# --- get_config: the constructor arguments that rebuild a module -------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (RelativeMultiheadAttention, dict(embed_dim=12, num_heads=3, max_distance=2,
                                          relative_values=False, share_heads=False,
                                          dropout=0.1, bias=False, kdim=5, vdim=7,
                                          add_zero_attn=False,
                                          batch_first=False, implementation="bucketed")),
        (RelativeMultiheadAttention, dict(embed_dim=8, num_heads=2, max_distance=3,
                                          relative_keys=False, relative_values=False,
                                          add_bias_kv=True, add_zero_attn=True)),
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
    layer = RelativeTransformerEncoderLayer(8, 2, max_distance=1)  # default activation F.relu
    assert layer.get_config()["activation"] == "relu"
    decoder = RelativeTransformerDecoderLayer(8, 2, max_distance=1)
    assert decoder.get_config()["relative_cross_attention"] is False
    with pytest.raises(ValueError, match=r"custom activation .*allowed: 'relu' or 'gelu'"):
        RelativeTransformerEncoderLayer(8, 2, activation=torch.tanh, max_distance=1).get_config()


@pytest.mark.parametrize("kwargs,exc,fragment", [
    (dict(embed_dim=10, num_heads=3, max_distance=2), ValueError, "not divisible by num_heads=3"),
    (dict(embed_dim=8, num_heads=0, max_distance=2), ValueError, "num_heads"),
    (dict(embed_dim=8, num_heads=2, max_distance=-1), ValueError, "max_distance"),
    (dict(embed_dim=8, num_heads=2, max_distance=2, dropout=1.5), ValueError, "dropout"),
])
def test_bad_module_construction(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        RelativeMultiheadAttention(**kwargs)


def test_bad_module_input_shape():
    mha = RelativeMultiheadAttention(8, 2, max_distance=2)
    with pytest.raises(ValueError, match=r"F=8, got \(2, 5, 7\)"):
        mha(torch.randn(2, 5, 7))
    with pytest.raises(TypeError, match="got list"):
        mha([[1.0]])


def test_huge_k_without_tables_allocates_nothing():
    # The table-size limit applies to tables only: without them any K is served.
    mha = RelativeMultiheadAttention(8, 2, batch_first=True, max_distance=10**9,
                                     relative_keys=False, relative_values=False)
    assert mha.rel_keys is None and mha.rel_values is None
    x = torch.randn(2, 5, 8)
    out, _ = mha(x, need_weights=False, is_causal=True)
    assert out.shape == (2, 5, 8)
    # Just under the limit (2**28 elements) still builds.
    big = RelativeMultiheadAttention(8, 2, max_distance=(2**28 // 4 - 1) // 2,
                                     relative_values=False, device="meta")
    assert big.rel_keys is not None and big.rel_keys.numel() <= 2**28


def test_old_positional_k_and_missing_k_are_refused_clearly():
    with pytest.raises(TypeError, match=r"pass max_distance=4$"):
        RelativeMultiheadAttention(8, 2, 4)
    with pytest.raises(TypeError, match="needs max_distance=K"):
        RelativeMultiheadAttention(8, 2, 0.1)  # nn's dropout, no K
    # nn's positional dropout works once K is given by keyword.
    assert RelativeMultiheadAttention(8, 2, 0.25, max_distance=4).dropout == 0.25
    assert RelativeMultiheadAttention(8, 2, 0, max_distance=4).dropout == 0.0
