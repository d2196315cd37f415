"""Positions: the clip and the relative index (bottom-right alignment), and their bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import relpos
from relpos import relative_position_index
from relpos.positions import check_int


@pytest.mark.parametrize("args,exc,fragment", [
    ((4, 4, -2), ValueError, "-2"),
    ((4, 4, 1.5), TypeError, "1.5"),
    ((-1, 4, 1), ValueError, "query_len"),
    ((5, 4, 1), ValueError, "L=5"),
    ((3, 4, 2**63), ValueError, r"left \+ right = 18446744073709551616, more than a torch.long"),
    ((3, 4, (2**62, 2**62)), ValueError, r"allowed: left \+ right <= 9223372036854775807"),
])
def test_bad_relative_position_index(args, exc, fragment):
    with pytest.raises(exc, match=fragment):
        relative_position_index(*args)


def test_bad_clip_relative_position():
    with pytest.raises(ValueError, match="-3"):
        relpos.clip_relative_position(1, 2, -3)
    with pytest.raises(TypeError, match="'a'"):
        relpos.clip_relative_position("a", 2, 3)


@pytest.mark.parametrize("window", [10**18, (2**63 - 1, 0), (0, 2**63 - 1), (5, 2**62)],
                         ids=str)
def test_huge_windows_index_like_the_clip(window):
    """Every window whose rows fit a torch.long works, whatever its size."""
    left = window if isinstance(window, int) else window[0]
    index = relative_position_index(3, 5, window)
    want = [[relpos.clip_relative_position(j, i + 2, window) + left for j in range(5)]
            for i in range(3)]
    assert index.tolist() == want


class _Index:
    """Anything with ``__index__`` is an int to PyTorch and NumPy."""

    def __index__(self) -> int:
        return 3

    def __repr__(self) -> str:
        return "_Index()"


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3),
                                   torch.tensor([3], dtype=torch.int32), _Index()], ids=repr)
def test_integer_like_values_are_ints(value):
    got = check_int(value, "n")
    assert got == 3 and type(got) is int
    assert relative_position_index(value, value, value).tolist() == \
        relative_position_index(3, 3, 3).tolist()
    assert relpos.clip_relative_position(value, 0, (value, 1)) == 1


@pytest.mark.parametrize("value", [True, np.True_, torch.tensor(True), 3.0, np.float64(3.0),
                                   torch.tensor(3.0), "3", None, torch.tensor([1, 2])],
                         ids=repr)
def test_bools_floats_and_others_are_not_ints(value):
    with pytest.raises(TypeError, match=r"^n must be a count, got .* of type "):
        check_int(value, "n", "a count")
    with pytest.raises(TypeError, match="query_start must be an int or None"):
        relative_position_index(3, 5, 1, query_start=value if value is not None else 1.5)
