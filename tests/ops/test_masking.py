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


def test_unguarded_softmax_equals_guarded_when_every_row_sees_a_key():
    from relpos.ops.masking import masked_softmax

    scores = torch.randn(2, 3, 6, 6, dtype=F64)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    for keep in (None, causal):
        guarded = masked_softmax(scores, keep)
        fast = masked_softmax(scores, keep, rows_may_be_empty=False)
        torch.testing.assert_close(fast, guarded, atol=0, rtol=0)
    for dtype in (torch.float16, torch.bfloat16):
        low = scores.to(dtype)
        assert masked_softmax(low, causal, rows_may_be_empty=False).dtype == dtype
        torch.testing.assert_close(masked_softmax(low, causal, rows_may_be_empty=False),
                                   masked_softmax(low, causal), atol=0, rtol=0)


def test_rows_may_be_empty_only_with_a_key_or_attention_mask():
    import relpos
    from relpos.functional import validate_call
    from relpos.ops.masking import rows_may_be_empty

    q = torch.randn(1, 2, 4, 8)
    kw = dict(max_distance=2, rel_keys=torch.randn(5, 8))
    assert not rows_may_be_empty(validate_call(q, q, q, **kw))
    assert not rows_may_be_empty(validate_call(q, q, q, is_causal=True, **kw))
    key_mask = torch.ones(1, 4, dtype=torch.bool)
    assert rows_may_be_empty(validate_call(q, q, q, key_mask=key_mask, **kw))
    mask = torch.zeros(4, 4)
    assert rows_may_be_empty(validate_call(q, q, q, attn_mask=mask, **kw))
    # a causal row always sees key 0, so the guard is not needed for correctness there:
    out = relpos.relative_attention(q, q, q, is_causal=True, implementation="bucketed", **kw)
    assert torch.isfinite(out).all()
