"""The decode backend (KV-cache steps) against the reference; what it serves; what it builds."""

from __future__ import annotations

import pytest
import torch

import relpos
from helpers import F64, make_problem
from relpos.functional import AttentionCall
from relpos.ops import decode


@pytest.mark.parametrize("K", [0, 1, 20])
@pytest.mark.parametrize("t,S", [(1, 1), (1, 9), (3, 3), (4, 11), (6, 30)])
@pytest.mark.parametrize(
    "per_head, terms",
    [(False, (True, True)), (True, (True, True)), (True, (True, False)), (False, (False, True))],
)
def test_decode_backend_matches_reference_forward_and_backward(K, t, S, per_head, terms):
    p = make_problem(B=2, H=3, L=t, S=S, D=5, K=K, per_head=per_head,
                     keys_term=terms[0], values_term=terms[1], seed=t * 100 + S)
    g = torch.Generator().manual_seed(1)
    key_mask = torch.rand(2, S, generator=g) > 0.3
    key_mask[:, -1] = True
    for causal in (True, False):
        for km in (None, key_mask):
            kw = dict(max_distance=K, rel_keys=p.rel_keys, rel_values=p.rel_values,
                      is_causal=causal, key_mask=km)
            out = relpos.relative_attention(p.query, p.key, p.value, implementation="decode", **kw)
            ref = relpos.relative_attention(p.query, p.key, p.value, implementation="reference",
                                            **kw)
            torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
            grad = torch.randn_like(out)
            got_g = torch.autograd.grad(out, p.leaves(), grad)
            ref_g = torch.autograd.grad(ref, p.leaves(), grad)
            for a, b in zip(got_g, ref_g, strict=True):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
            with torch.no_grad():  # the inference fast path (flash kernel over the far keys)
                fast = relpos.relative_attention(
                    p.query, p.key, p.value, implementation="decode", **kw
                )
            torch.testing.assert_close(fast, ref, atol=1e-12, rtol=0)


def test_decode_backend_fast_path_float32_and_dead_rows():
    p = make_problem(B=2, H=2, L=3, S=40, D=8, K=4, dtype=torch.float32, seed=3)
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1] = False  # row 1 sees no key at all: zeros, not NaN
    with torch.no_grad():
        for km in (None, key_mask):
            kw = dict(max_distance=4, rel_keys=p.rel_keys, rel_values=p.rel_values,
                      is_causal=True, key_mask=km)
            out = relpos.relative_attention(p.query, p.key, p.value, implementation="decode", **kw)
            ref = relpos.relative_attention(p.query, p.key, p.value, implementation="reference",
                                            **kw)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.all(out[1] == 0)


def test_decode_backend_without_tables_and_gradcheck_masks_dropout():
    p = make_problem(B=2, H=2, L=3, S=8, D=4, K=2, keys_term=False, values_term=False)
    for causal in (True, False):
        torch.testing.assert_close(
            relpos.relative_attention(p.query, p.key, p.value, max_distance=2,
                                      is_causal=causal, implementation="decode"),
            relpos.relative_attention(p.query, p.key, p.value, max_distance=2,
                                      is_causal=causal, implementation="reference"),
            atol=1e-12, rtol=0,
        )
    p = make_problem(B=1, H=2, L=2, S=7, D=3, K=2, seed=5)
    mask = torch.randn(2, 7, dtype=F64)

    def fn(q, k, v, ak, av):  # type: ignore[no-untyped-def]
        return relpos.relative_attention(q, k, v, max_distance=2, rel_keys=ak, rel_values=av,
                                         is_causal=True, attn_mask=mask, implementation="decode")

    assert torch.autograd.gradcheck(fn, tuple(p.leaves()))
    bool_mask = torch.rand(1, 2, 2, 7) > 0.4
    kw = dict(max_distance=2, rel_keys=p.rel_keys, rel_values=p.rel_values, attn_mask=bool_mask)
    torch.testing.assert_close(
        relpos.relative_attention(p.query, p.key, p.value, implementation="decode", **kw),
        relpos.relative_attention(p.query, p.key, p.value, implementation="reference", **kw),
        atol=1e-12, rtol=0,
    )
    torch.manual_seed(7)
    a = relpos.relative_attention(p.query, p.key, p.value, dropout_p=0.5,
                                  implementation="decode", **kw)
    torch.manual_seed(7)
    b = relpos.relative_attention(p.query, p.key, p.value, dropout_p=0.5,
                                  implementation="reference", **kw)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_decode_backend_refuses_what_it_cannot_serve():
    p = make_problem(L=3, S=9)
    base = dict(rel_keys=None, rel_values=None, left=2, right=2, attn_mask=None, key_mask=None,
                is_causal=True, dropout_p=0.0, scale=0.5)
    assert decode.unsupported_reason(
        AttentionCall(p.query, p.key, p.value, query_start=6, **base)) is None
    assert "query_start" in decode.unsupported_reason(  # type: ignore[operator]
        AttentionCall(p.query, p.key, p.value, query_start=2, **base))
    big = torch.randn(1, 1, decode.MAX_QUERIES + 1, 4)
    assert "L=" in decode.unsupported_reason(  # type: ignore[operator]
        AttentionCall(big, big, big, query_start=0, **base))
    with pytest.raises(RuntimeError, match="query_start"):
        relpos.relative_attention(p.query, p.key, p.value, max_distance=2, query_start=2,
                                  is_causal=True, implementation="decode")


@pytest.mark.parametrize("grad", [False, True])
def test_decode_step_builds_nothing_of_size_t_by_S_by_D(grad):
    """No intermediate of a decode step is larger than the cached keys (B·H·S·D): the
    reference's (t, S, D) relative tensor (4x larger here) never appears, with or without
    autograd (eager path) and through the inference fast path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    B, H, t, S, D, K = 1, 1, 4, 1000, 8, 50
    p = make_problem(B=B, H=H, L=t, S=S, D=D, K=K, dtype=torch.float32, seed=4)
    sizes: list[int] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, tuple | list) else (out,):
                if isinstance(o, torch.Tensor):
                    sizes.append(o.numel())
            return out

    kw = dict(max_distance=K, rel_keys=p.rel_keys, rel_values=p.rel_values, is_causal=True)
    with torch.set_grad_enabled(grad), Record():
        out = relpos.relative_attention(p.query, p.key, p.value, implementation="decode", **kw)
    assert out.shape == (B, H, t, D)
    assert max(sizes) <= B * H * S * D
    sizes.clear()
    with torch.no_grad(), Record():
        relpos.relative_attention(p.query, p.key, p.value, implementation="reference", **kw)
    assert max(sizes) >= t * S * D  # the check above can fail


def test_auto_dispatch_picks_decode_for_cache_steps_only(monkeypatch, no_native):
    calls: list[str] = []
    real = decode.attention
    monkeypatch.setattr(decode, "attention",
                        lambda *a, **k: calls.append("decode") or real(*a, **k))
    step = make_problem(B=1, H=2, L=3, S=600, D=4, K=2, seed=1)
    kw = dict(max_distance=2, rel_keys=step.rel_keys, rel_values=step.rel_values, is_causal=True)
    relpos.relative_attention(step.query, step.key, step.value, **kw)
    assert calls == ["decode"]
    assert relpos.explain_backends(step.query, step.key, step.value, **kw)["decode"] is None
    with pytest.warns(DeprecationWarning, match="use relpos.explain_backends"):
        reason = relpos.why_not_fused(step.query, step.key, step.value, **kw)
    assert "decode backend is picked first" in str(reason)
    calls.clear()
    whole = make_problem(B=1, H=2, L=9, S=9, D=4, K=2, seed=1)  # not a cache step
    kw = dict(max_distance=2, rel_keys=whole.rel_keys, rel_values=whole.rel_values, is_causal=True)
    relpos.relative_attention(whole.query, whole.key, whole.value, **kw)
    assert calls == []


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_single_token_step_is_one_flash_call_without_a_merge(per_head):
    from torch.utils._python_dispatch import TorchDispatchMode

    p = make_problem(B=2, H=3, L=1, S=50, D=8, K=6, per_head=per_head, dtype=torch.float32,
                     seed=5)
    names: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    kw = dict(max_distance=6, rel_keys=p.rel_keys, rel_values=p.rel_values, is_causal=True)
    with torch.no_grad():
        ref = relpos.relative_attention(p.query, p.key, p.value, implementation="reference",
                                        **kw)
        with Record():
            out = relpos.relative_attention(p.query, p.key, p.value, implementation="decode",
                                            **kw)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)
    flash = [n for n in names if n.startswith("_scaled_dot_product_flash_attention_for_cpu")]
    assert len(flash) == 1, names
    assert not any(n.startswith(("logsumexp", "logaddexp")) for n in names), names
