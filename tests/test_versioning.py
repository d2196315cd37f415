"""Saved states carry their meaning (format version, K, convention); tables resize exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import relpos
from relpos.export import ModuleFormatError, load_module, save_module
from relpos.versioning import (
    ALIGNMENT_BOTTOM_RIGHT,
    FORMAT_VERSION,
    OFFSET_KEY_MINUS_QUERY,
    RelativeStateError,
)

F64 = torch.float64


def _mha(K: int, **kwargs: object) -> relpos.RelativeMultiheadAttention:
    torch.manual_seed(0)
    return relpos.RelativeMultiheadAttention(  # type: ignore[arg-type]
        12, 3, batch_first=True, max_distance=K, dtype=F64, **kwargs
    )


# --- the saved state ---------------------------------------------------------------------


def test_state_carries_version_k_and_convention():
    state = _mha(4).state_dict()["_extra_state"]
    assert state.dtype == torch.int64
    assert state.tolist() == [FORMAT_VERSION, 4, OFFSET_KEY_MINUS_QUERY, ALIGNMENT_BOTTOM_RIGHT]
    assert (OFFSET_KEY_MINUS_QUERY, ALIGNMENT_BOTTOM_RIGHT) == (1, 1)


def test_same_k_round_trip_nested():
    torch.manual_seed(0)
    a = nn.TransformerEncoder(
        relpos.RelativeTransformerEncoderLayer(12, 3, 24, batch_first=True, max_distance=3),
        num_layers=2, enable_nested_tensor=False,
    )
    torch.manual_seed(1)
    b = nn.TransformerEncoder(
        relpos.RelativeTransformerEncoderLayer(12, 3, 24, batch_first=True, max_distance=3),
        num_layers=2, enable_nested_tensor=False,
    )
    keys = [k for k in a.state_dict() if k.endswith("_extra_state")]
    assert keys == ["layers.0.self_attn._extra_state", "layers.1.self_attn._extra_state"]
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 9, 12)
    torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=0, atol=0)


def test_different_k_raises_naming_both_and_the_way_out():
    sd = _mha(2).state_dict()
    with pytest.raises(RelativeStateError, match=r"max_distance=2 .*max_distance=5") as info:
        _mha(5).load_state_dict(sd)
    assert "load_state_dict_resized" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_different_k_in_nested_module_names_the_submodule():
    torch.manual_seed(0)
    small = relpos.RelativeTransformerEncoderLayer(12, 3, 24, max_distance=2)
    big = relpos.RelativeTransformerEncoderLayer(12, 3, 24, max_distance=4)
    with pytest.raises(RelativeStateError, match=r"^self_attn: .*max_distance=2"):
        big.load_state_dict(small.state_dict())


def test_table_rows_checked_without_extra_state():
    sd = _mha(2).state_dict()
    del sd["_extra_state"]
    with pytest.raises(RelativeStateError, match=r"5 rows .*max_distance=3 \(7 rows\)"):
        _mha(3).load_state_dict(sd, strict=False)
    with pytest.raises(RuntimeError, match="_extra_state"):  # strict: the meaning is missing
        _mha(2).load_state_dict(sd)
    _mha(2).load_state_dict(sd, strict=False)  # opting out of the check is explicit


@pytest.mark.parametrize("resize", [False, True])
def test_other_convention_raises_even_with_resize(resize):
    sd = _mha(2).state_dict()
    sd["_extra_state"] = torch.tensor([FORMAT_VERSION, 2, -1, ALIGNMENT_BOTTOM_RIGHT])
    target = _mha(2)
    with pytest.raises(RelativeStateError, match="offset i - j"):
        if resize:
            relpos.load_state_dict_resized(target, sd)
        else:
            target.load_state_dict(sd)
    sd["_extra_state"] = torch.tensor([FORMAT_VERSION, 2, OFFSET_KEY_MINUS_QUERY, 0])
    with pytest.raises(RelativeStateError, match="top-left alignment"):
        target.load_state_dict(sd)


def test_newer_format_version_raises():
    sd = _mha(2).state_dict()
    sd["_extra_state"] = torch.tensor([FORMAT_VERSION + 1, 2, 1, 1])
    with pytest.raises(RelativeStateError, match=f"format version {FORMAT_VERSION + 1}"):
        _mha(2).load_state_dict(sd)


def test_garbage_state_raises():
    sd = _mha(2).state_dict()
    sd["_extra_state"] = torch.zeros(2)
    with pytest.raises(RelativeStateError, match="unrecognized relpos module state"):
        _mha(2).load_state_dict(sd)


# --- resizing ----------------------------------------------------------------------------














# --- saved modules -----------------------------------------------------------------------


def test_save_module_round_trip_and_checks(tmp_path):
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(
        12, 3, 24, dropout=0.0, activation="gelu", batch_first=True, norm_first=True,
        max_distance=3, share_heads=False,
    )
    path = save_module(tmp_path / "layer.pt", layer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer.pt"]  # no temp file left
    loaded = load_module(path)
    x = torch.randn(2, 7, 12)
    torch.testing.assert_close(loaded(x), layer.eval()(x), rtol=0, atol=0)

    payload = torch.load(path, weights_only=True)
    payload["state_dict"]["self_attn._extra_state"] = torch.tensor([1, 9, 1, 1])
    torch.save(payload, tmp_path / "k9.pt")
    with pytest.raises(RelativeStateError, match="max_distance=9"):
        load_module(tmp_path / "k9.pt")
    payload["format_version"] = 99
    torch.save(payload, tmp_path / "v99.pt")
    with pytest.raises(ModuleFormatError, match="format version 99"):
        load_module(tmp_path / "v99.pt")
    torch.save(layer.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(ModuleFormatError, match="bare state_dict"):
        load_module(tmp_path / "bare.pt")
