"""Bad input to the core API gives a clear ValueError/TypeError, never a crash inside torch."""

from __future__ import annotations

import pytest
import torch

from relpos import relative_attention

F64 = torch.float64


def _qkv(B=2, H=3, L=4, S=4, D=5, Dv=5, dtype=F64):
    return (torch.randn(B, H, L, D, dtype=dtype), torch.randn(B, H, S, D, dtype=dtype),
            torch.randn(B, H, S, Dv, dtype=dtype))


def _call(**overrides):
    q, k, v = _qkv()
    kwargs = dict(max_distance=2, rel_keys=torch.randn(5, 5, dtype=F64),
                  rel_values=torch.randn(5, 5, dtype=F64))
    kwargs.update(overrides)
    q = kwargs.pop("query", q)
    k = kwargs.pop("key", k)
    v = kwargs.pop("value", v)
    return relative_attention(q, k, v, **kwargs)


CASES = [
    # (id, overrides, exception, message fragments)
    ("negative K", dict(max_distance=-1), ValueError, ["max_distance", "-1"]),
    ("float K", dict(max_distance=2.0), TypeError, ["max_distance", "2.0"]),
    ("bool K", dict(max_distance=True), TypeError, ["max_distance", "True"]),
    ("table rows", dict(rel_keys=torch.randn(4, 5, dtype=F64)), ValueError,
     ["rel_keys", "4 rows", "2K+1 = 5"]),
    ("table dim", dict(rel_keys=torch.randn(5, 6, dtype=F64)), ValueError, ["rel_keys", "6", "D"]),
    ("value table dim", dict(rel_values=torch.randn(5, 4, dtype=F64)), ValueError,
     ["rel_values", "Dv"]),
    ("table heads", dict(rel_keys=torch.randn(2, 5, 5, dtype=F64)), ValueError,
     ["rel_keys", "2 heads", "H=3"]),
    ("table 4-D", dict(rel_keys=torch.randn(1, 3, 5, 5, dtype=F64)), ValueError,
     ["rel_keys", "4-D"]),
    ("query 3-D", dict(query=torch.randn(3, 4, 5, dtype=F64)), ValueError,
     ["query", "4-D", "(3, 4, 5)"]),
    ("batch mismatch", dict(key=torch.randn(1, 3, 4, 5, dtype=F64)), ValueError,
     ["batch", "query 2", "key 1"]),
    ("heads mismatch", dict(value=torch.randn(2, 2, 4, 5, dtype=F64)), ValueError,
     ["head", "value 2"]),
    ("D mismatch", dict(key=torch.randn(2, 3, 4, 6, dtype=F64)), ValueError, ["head dim", "6"]),
    ("S mismatch", dict(value=torch.randn(2, 3, 6, 5, dtype=F64)), ValueError,
     ["value has 6", "key has 4"]),
    ("dtype mismatch", dict(key=torch.randn(2, 3, 4, 5)), TypeError, ["dtype", "float32"]),
    ("table dtype", dict(rel_keys=torch.randn(5, 5)), TypeError, ["rel_keys", "float32"]),
    ("int query", dict(query=torch.ones(2, 3, 4, 5, dtype=torch.long)), TypeError,
     ["query", "floating", "int64"]),
    ("mask shape", dict(attn_mask=torch.ones(3, 4, dtype=torch.bool)), ValueError,
     ["attn_mask", "(3, 4)", "(2, 3, 4, 4)"]),
    ("mask 5-D", dict(attn_mask=torch.ones(1, 1, 1, 4, 4, dtype=torch.bool)), ValueError,
     ["attn_mask"]),
    ("mask dtype", dict(attn_mask=torch.ones(4, 4, dtype=torch.long)), TypeError,
     ["attn_mask", "int64"]),
    ("float mask dtype", dict(attn_mask=torch.zeros(4, 4)), TypeError,
     ["attn_mask", "float32"]),
    ("key_mask shape", dict(key_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError,
     ["key_mask", "(2, 4)", "(2, 5)"]),
    ("key_mask dtype", dict(key_mask=torch.ones(2, 4)), TypeError, ["key_mask", "bool"]),
    ("dropout 1", dict(dropout_p=1.0), ValueError, ["dropout_p", "[0, 1)", "1.0"]),
    ("dropout negative", dict(dropout_p=-0.1), ValueError, ["dropout_p", "-0.1"]),
    ("query_start beyond keys", dict(query_start=1), ValueError,
     ["query_start=1", "0 <= query_start <= 0"]),
    ("query_start negative", dict(query_start=-1), ValueError, ["query_start=-1"]),
    ("more queries than keys", dict(query=torch.randn(2, 3, 6, 5, dtype=F64)), ValueError,
     ["L=6", "S=4"]),
    ("unknown implementation", dict(implementation="flash"), ValueError,
     ["'flash'", "'reference'", "'bucketed'"]),
    ("is_causal not bool", dict(is_causal=1), TypeError, ["is_causal", "1"]),
    ("scale not number", dict(scale="big"), TypeError, ["scale", "'big'"]),
    ("query not tensor", dict(query=[1, 2]), TypeError, ["query", "list"]),
]


@pytest.mark.parametrize("overrides,exc,fragments", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_functional_input(overrides, exc, fragments):
    with pytest.raises(exc) as info:
        _call(**overrides)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_named_backend_that_cannot_serve_raises_runtime_error(monkeypatch):
    from relpos.ops import bucketed

    monkeypatch.setattr(bucketed, "unsupported_reason", lambda *a, **k: "no reason at all")
    with pytest.raises(RuntimeError, match="'bucketed' cannot serve this call: no reason at all"):
        _call(implementation="bucketed")


def test_integer_like_arguments_are_ints_across_the_api():
    # Anything with __index__ (NumPy integers, integer tensors of one element), as PyTorch
    # takes it: the functional call, a window, query_start, the modules' sizes.
    import numpy as np

    import relpos

    q, k, v = _qkv(L=3)
    table = torch.randn(5, 5, dtype=F64)
    want = relative_attention(q, k, v, max_distance=2, rel_keys=table, query_start=1)
    for two, one in ((np.int64(2), np.int32(1)), (torch.tensor(2), torch.tensor(1))):
        got = relative_attention(q, k, v, max_distance=two, rel_keys=table, query_start=one)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        window = relative_attention(q, k, v, max_distance=(two, np.uint8(2)), rel_keys=table,
                                    query_start=one)
        torch.testing.assert_close(window, want, rtol=0, atol=0)
    mha = relpos.RelativeMultiheadAttention(np.int64(8), torch.tensor(2),
                                            max_distance=np.int64(3), kdim=np.int32(8))
    assert (mha.embed_dim, mha.num_heads, mha.kdim) == (8, 2, 8)
    assert all(type(x) is int for x in (mha.embed_dim, mha.num_heads, mha.kdim))
    for bad in (torch.tensor(True), np.float64(2.0), torch.tensor(2.0)):
        with pytest.raises(TypeError, match="max_distance must be a non-negative int"):
            relative_attention(q, k, v, max_distance=bad)
        with pytest.raises(TypeError, match="num_heads must be a positive int"):
            relpos.RelativeMultiheadAttention(8, bad, max_distance=2)
