"""The triton backend's packed variable-length op ``relpos::triton_attention_varlen`` under
Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1`` from ``tests/conftest.py``), against
one float64 reference call per sequence.

The interpreter runs each program in Python (~0.05 s), so the batches are tiny and the blocks
forced to 4 x 4 (:data:`launch.FORCED`): sequences of 0, 1, 2, K, K + 1 and ~20 queries cross
partial blocks, band and far tiles; a sequence with queries but no key gives zeros.
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch

import relpos
from relpos import varlen
from relpos.varlen import explain_backends_varlen, select_backend_varlen

if importlib.util.find_spec("triton") is None and not os.environ.get("CI"):
    pytest.skip("triton is not installed (the dev extra has it on Linux; CI fails without it)",
                allow_module_level=True)

from relpos.ops.triton import launch  # (imports triton)

F64 = torch.float64
H = 2
K = 2
# (queries, key region, keys used) per sequence: empty, no key, 1, 2, K, K + 1, ~20 queries
LENGTHS = ((0, 0, 0), (0, 3, 3), (2, 0, 0), (1, 1, 1), (2, 2, 2), (2, 5, 5), (3, 3, 3),
           (19, 21, 21))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(launch, "FORCED", launch.Blocks(4, 4))


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)])


def _problem(lengths=LENGTHS, *, D=4, Dv=4, keys=True, values=True, per_head=False, window=(K, K),
             seed=0):
    g = torch.Generator().manual_seed(seed)
    Ls, regions, used = zip(*lengths, strict=True)
    R = window[0] + window[1] + 1
    Hr = H if per_head else 1

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)

    return dict(
        q=leaf(sum(Ls), H, D), k=leaf(sum(regions), H, D), v=leaf(sum(regions), H, Dv),
        rk=leaf(Hr, R, D) if keys else None, rv=leaf(Hr, R, Dv) if values else None,
        cu_q=_cu(Ls), cu_k=_cu(regions),
        used=None if list(used) == list(regions) else torch.tensor(used),
        Ls=Ls, used_k=used, window=window,
    )


def _inputs(p):
    return [t for t in (p["q"], p["k"], p["v"], p["rk"], p["rv"]) if t is not None]


def _tables(p):
    """The tables as the padded API takes them (a shared one as ``(R, X)``)."""
    return tuple(None if t is None else t[0] if t.shape[0] == 1 else t
                 for t in (p["rk"], p["rv"]))


def _reference(p, grad, *, is_causal, scale):
    """Output and gradients from one reference call per sequence."""
    rk, rv = _tables(p)
    out = torch.zeros(p["q"].shape[0], H, p["v"].shape[2], dtype=F64)
    q0s, k0s = p["cu_q"].tolist(), p["cu_k"].tolist()
    total = p["q"].sum() * 0
    for s, (L, S) in enumerate(zip(p["Ls"], p["used_k"], strict=True)):
        if L == 0 or S == 0:
            continue
        q0, k0 = q0s[s], k0s[s]
        o = relpos.relative_attention(
            p["q"][q0:q0 + L].transpose(0, 1)[None], p["k"][k0:k0 + S].transpose(0, 1)[None],
            p["v"][k0:k0 + S].transpose(0, 1)[None], max_distance=p["window"], rel_keys=rk,
            rel_values=rv, is_causal=is_causal, scale=scale, implementation="reference",
        )[0].transpose(0, 1)
        out[q0:q0 + L] = o.detach()
        total = total + (o * grad[q0:q0 + L]).sum()
    grads = torch.autograd.grad(total, _inputs(p), allow_unused=True)
    return out, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, _inputs(p),
                                                                          strict=True)]


def _op(p, *, is_causal, scale):
    left, right = p["window"]
    return torch.ops.relpos.triton_attention_varlen(
        p["q"], p["k"], p["v"], p["rk"], p["rv"], p["cu_q"], p["cu_k"], p["used"], left=left,
        right=right, is_causal=is_causal, scale=scale)


def _check(p, *, is_causal, scale=0.5):
    out, lse, _pb = _op(p, is_causal=is_causal, scale=scale)
    assert out.shape == (p["q"].shape[0], H, p["v"].shape[2])
    assert lse.shape == (H, p["q"].shape[0])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = torch.autograd.grad(out, _inputs(p), grad)
    out_ref, grads_ref = _reference(p, grad, is_causal=is_causal, scale=scale)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-10)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("is_causal", [False, True])
def test_float64_matches_one_reference_call_per_sequence(is_causal):
    _check(_problem(), is_causal=is_causal)


@pytest.mark.parametrize("case", [
    dict(keys=False),
    dict(values=False, per_head=True),
    dict(per_head=True, D=8, Dv=4),
    dict(keys=False, values=False),
])
def test_terms_tables_and_value_dims(case):
    lengths = ((1, 1, 1), (3, 4, 4), (9, 9, 9))
    _check(_problem(lengths, **case), is_causal=True)


def test_window_left_differs_from_right():
    lengths = ((2, 2, 2), (5, 7, 7), (13, 13, 13))
    _check(_problem(lengths, window=(3, 1), per_head=True), is_causal=False)
    _check(_problem(lengths, window=(0, 2), seed=1), is_causal=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_seqused_k_reads_only_the_used_keys(is_causal):
    lengths = ((2, 6, 3), (0, 4, 2), (1, 3, 0), (4, 9, 7))
    p = _problem(lengths, Dv=8)
    _check(p, is_causal=is_causal)
    out, _, _ = _op(p, is_causal=is_causal, scale=0.5)
    dk, dv = torch.autograd.grad(out.sum(), (p["k"], p["v"]))
    spare = torch.ones(p["k"].shape[0], dtype=torch.bool)
    for k0, S in zip(p["cu_k"].tolist(), p["used_k"], strict=False):
        spare[k0:k0 + S] = False
    assert spare.any()
    assert (dk[spare] == 0).all() and (dv[spare] == 0).all()


def test_table_gradients_are_deterministic():
    p = _problem(((3, 5, 5), (6, 6, 6)), per_head=True)
    runs = []
    for _ in range(2):
        out, _, _ = _op(p, is_causal=True, scale=0.5)
        runs.append(torch.autograd.grad(out.sum(), (p["rk"], p["rv"])))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_opcheck():
    p = _problem(((1, 2, 2), (3, 3, 3)))
    args = (p["q"], p["k"], p["v"], p["rk"], p["rv"], p["cu_q"], p["cu_k"], None)
    torch.library.opcheck(torch.ops.relpos.triton_attention_varlen.default, args,
                          dict(left=K, right=K, is_causal=True, scale=0.5))


def test_the_public_api_takes_one_call_and_matches_the_reference(monkeypatch):
    p = _problem(((2, 2, 2), (0, 0, 0), (5, 6, 6)))
    kwargs = dict(max_distance=K, rel_keys=p["rk"][0], rel_values=p["rv"][0], is_causal=True)
    args = (p["q"], p["k"], p["v"], p["cu_q"], p["cu_k"])
    ref = relpos.relative_attention_varlen(*args, **kwargs, implementation="reference")

    def per_sequence(*_args, **_kwargs):
        raise AssertionError("the triton backend served the packed call one sequence at a time")

    monkeypatch.setattr(varlen, "_per_sequence", per_sequence)
    out = relpos.relative_attention_varlen(*args, **kwargs, implementation="triton")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_selection_and_reasons():
    p = _problem(((2, 2, 2), (5, 6, 6)))
    args = (p["q"], p["k"], p["v"], p["cu_q"], p["cu_k"])
    kwargs = dict(max_distance=K, rel_keys=p["rk"][0])
    assert explain_backends_varlen(*args, **kwargs, implementation="triton")["triton"] is None
    assert select_backend_varlen(*args, **kwargs) != "triton"  # CPU: auto never picks it
    reason = explain_backends_varlen(*args, **kwargs, dropout_p=0.1,
                                     implementation="triton")["triton"]
    assert reason is not None and "dropout" in reason and "one call" in reason
    with pytest.raises(RuntimeError, match="dropout"):
        relpos.relative_attention_varlen(*args, **kwargs, dropout_p=0.1,
                                         implementation="triton")


def test_non_contiguous_inputs():
    # Head-major memory seen as (T, H, D), and a strided slice of a wider tensor: the same
    # numbers and gradients as the reference on the same views.
    p = _problem(((2, 3, 3), (5, 5, 5)), per_head=True)
    g = torch.Generator().manual_seed(4)
    T, Tk = p["q"].shape[0], p["k"].shape[0]
    p["q"] = torch.randn(H, T, 4, generator=g, dtype=F64).transpose(0, 1).requires_grad_(True)
    wide = torch.randn(Tk, H, 12, generator=g, dtype=F64)
    p["k"] = wide[:, :, ::3].detach().requires_grad_(True)  # stride 3 in the last dim
    assert not p["q"].is_contiguous() and not p["k"].is_contiguous()
    _check(p, is_causal=True)
