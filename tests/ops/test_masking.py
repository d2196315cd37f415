"""Masks and the guarded softmax shared by the backends."""

from __future__ import annotations

import torch

from helpers import F64
from relpos.ops import reference


def test_reference_masked_softmax_matches_softmax_on_live_rows():
    scores = torch.randn(2, 3, 4, 5, dtype=F64)
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[1, 3] = False
    probs = reference.masked_softmax(scores, keep)
    expected = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    torch.testing.assert_close(probs, expected)
