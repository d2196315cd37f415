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
])
def test_bad_relative_position_index(args, exc, fragment):
    with pytest.raises(exc, match=fragment):
        relative_position_index(*args)


def test_bad_clip_relative_position():
    with pytest.raises(ValueError, match="-3"):
        relpos.clip_relative_position(1, 2, -3)
    with pytest.raises(TypeError, match="'a'"):
        relpos.clip_relative_position("a", 2, 3)
