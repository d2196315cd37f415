"""Positions: the clip and the relative index (bottom-right alignment), and their bad input."""

from __future__ import annotations

import pytest

import relpos
from relpos import relative_position_index


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
