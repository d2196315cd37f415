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
    describe_state,
    parse_state,
)

F64 = torch.float64


def _mha(K: int, **kwargs: object) -> relpos.RelativeMultiheadAttention:
    torch.manual_seed(0)
    return relpos.RelativeMultiheadAttention(  # type: ignore[arg-type]
        12, 3, batch_first=True, max_distance=K, dtype=F64, **kwargs
    )


# --- the saved state ---------------------------------------------------------------------


def test_state_carries_version_k_and_convention():
    # A clip distance K is written in format version 1, as every earlier relpos wrote it.
    state = _mha(4).state_dict()["_extra_state"]
    assert state.dtype == torch.int64
    assert state.tolist() == [1, 4, OFFSET_KEY_MINUS_QUERY, ALIGNMENT_BOTTOM_RIGHT]
    assert (OFFSET_KEY_MINUS_QUERY, ALIGNMENT_BOTTOM_RIGHT) == (1, 1)
    assert FORMAT_VERSION == 2


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
    sd["_extra_state"] = torch.tensor([1, 2, -1, ALIGNMENT_BOTTOM_RIGHT])
    target = _mha(2)
    with pytest.raises(RelativeStateError, match="offset i - j"):
        if resize:
            relpos.load_state_dict_resized(target, sd)
        else:
            target.load_state_dict(sd)
    sd["_extra_state"] = torch.tensor([1, 2, OFFSET_KEY_MINUS_QUERY, 0])
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


# --- windows: format version 2 ----------------------------------------------------------


def test_window_state_is_format_version_2_and_symmetric_windows_stay_version_1():
    assert _mha((5, 2)).state_dict()["_extra_state"].tolist() == [2, 5, 2, 1, 1]
    assert _mha((0, 0)).state_dict()["_extra_state"].tolist() == [1, 0, 1, 1]
    assert _mha((3, 3)).state_dict()["_extra_state"].tolist() == [1, 3, 1, 1]
    fields = parse_state(torch.tensor([2, 64, 8, 1, 1]))
    assert fields == {"format_version": 2, "left": 64, "right": 8, "max_distance": (64, 8),
                      "offset_sign": 1, "alignment": 1}
    assert parse_state(torch.tensor([1, 4, 1, 1]))["max_distance"] == 4
    assert describe_state(fields) == (
        "max_distance=(64, 8) (73 rows), offset j - i, bottom-right alignment")


@pytest.mark.parametrize("window", [(5, 2), (0, 5), (5, 0), (64, 8), (2, 40)])
def test_same_window_round_trips_through_torch_save(window, tmp_path):
    a = _mha(window, share_heads=False)
    torch.save(a.state_dict(), tmp_path / "s.pt")
    torch.manual_seed(9)
    b = relpos.RelativeMultiheadAttention(12, 3, batch_first=True, max_distance=window,
                                          share_heads=False, dtype=F64)
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    x = torch.randn(2, 9, 12, dtype=F64)
    torch.testing.assert_close(b(x)[0], a(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize(("saved", "target", "saved_text", "target_text"), [
    ((5, 2), (2, 5), "(5, 2) (8 rows)", "(2, 5) (8 rows)"),  # same rows, another window
    ((5, 2), 3, "(5, 2) (8 rows)", "3 (7 rows)"),
    (3, (3, 0), "3 (7 rows)", "(3, 0) (4 rows)"),
    ((0, 0), (0, 1), "0 (1 row)", "(0, 1) (2 rows)"),  # (0, 0) is saved as K = 0
])
def test_other_window_is_refused_naming_both_and_the_way_out(saved, target, saved_text,
                                                             target_text):
    sd = _mha(saved).state_dict()
    with pytest.raises(RelativeStateError) as info:
        _mha(target).load_state_dict(sd)
    assert (f"trained with max_distance={saved_text} but this module has "
            f"max_distance={target_text}; to load them anyway use "
            f"relpos.load_state_dict_resized(module, state_dict)") in str(info.value)
    assert "resizes each side" in str(info.value)
    relpos.load_state_dict_resized(_mha(target), sd)  # the way out works


def test_window_refused_in_a_nested_module_names_it_and_copies_nothing():
    torch.manual_seed(0)
    a = relpos.RelativeTransformerEncoderLayer(12, 3, 24, max_distance=(5, 2))
    b = relpos.RelativeTransformerEncoderLayer(12, 3, 24, max_distance=(2, 5))
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with pytest.raises(RelativeStateError, match=r"^self_attn: .*\(5, 2\).*\(2, 5\)"):
        b.load_state_dict(a.state_dict())
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_table_rows_of_a_window_checked_without_extra_state():
    sd = _mha((5, 2)).state_dict()
    del sd["_extra_state"]
    with pytest.raises(RelativeStateError, match=r"8 rows .*max_distance=\(1, 1\) \(3 rows\)"):
        _mha((1, 1)).load_state_dict(sd, strict=False)


@pytest.mark.parametrize("window", [4, (4, 4), [4, 4]])
def test_version_1_states_load_as_the_symmetric_window(window):
    # [1, K, sign, alignment] as relpos wrote it before windows existed.
    old = _mha(4)
    sd = old.state_dict()
    sd["_extra_state"] = torch.tensor([1, 4, 1, 1])
    new = _mha(window, share_heads=True)
    torch.manual_seed(5)
    for p in new.parameters():
        p.data.normal_()
    new.load_state_dict(sd)
    x = torch.randn(2, 11, 12, dtype=F64)
    torch.testing.assert_close(new(x)[0], old(x)[0], rtol=0, atol=0)
    with pytest.raises(RelativeStateError, match=r"max_distance=4 \(9 rows\).*\(4, 2\)"):
        _mha((4, 2)).load_state_dict(sd)


@pytest.mark.parametrize(("state", "fragment"), [
    (torch.tensor([2, 5, 2, 1]), "format version 2 has 5 values"),
    (torch.tensor([2, -5, 2, 1, 1]), "negative clip distance"),
    (torch.tensor([1, -1, 1, 1]), "negative clip distance"),
    (torch.tensor([3, 5, 2, 1, 1]), "format version 3; this relpos reads versions 1..2"),
    (torch.tensor([2.0, 5.5, 2, 1, 1]), "whole finite numbers"),
])
def test_bad_window_states_are_refused(state, fragment):
    sd = _mha((5, 2)).state_dict()
    sd["_extra_state"] = state
    with pytest.raises(RelativeStateError, match=fragment):
        _mha((5, 2)).load_state_dict(sd)


def test_window_state_with_other_convention_raises_even_with_resize():
    sd = _mha((5, 2)).state_dict()
    sd["_extra_state"] = torch.tensor([2, 5, 2, -1, 1])
    with pytest.raises(RelativeStateError, match=r"\(5, 2\) \(8 rows\), offset i - j"):
        relpos.load_state_dict_resized(_mha((3, 1)), sd)


def test_save_module_round_trips_windows_and_refuses_an_edited_window(tmp_path):
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(12, 3, 24, batch_first=True,
                                                   max_distance=(6, 1), share_heads=False)
    path = save_module(layer, tmp_path / "layer.pt")
    loaded = load_module(path)
    assert loaded.self_attn.max_distance == (6, 1)
    x = torch.randn(2, 9, 12)
    torch.testing.assert_close(loaded(x), layer.eval()(x), rtol=0, atol=0)
    payload = torch.load(path, weights_only=True)
    payload["state_dict"]["self_attn._extra_state"] = torch.tensor([2, 1, 6, 1, 1])
    torch.save(payload, tmp_path / "flipped.pt")
    with pytest.raises(RelativeStateError, match=r"\(1, 6\) \(8 rows\).*\(6, 1\)"):
        load_module(tmp_path / "flipped.pt")


# --- resizing ----------------------------------------------------------------------------














# --- saved modules -----------------------------------------------------------------------


def test_save_module_round_trip_and_checks(tmp_path):
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(
        12, 3, 24, dropout=0.0, activation="gelu", batch_first=True, norm_first=True,
        max_distance=3, share_heads=False,
    )
    path = save_module(layer, tmp_path / "layer.pt")
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
