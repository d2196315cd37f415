"""Packed calls without a packed kernel (relpos.varlen.selection, relpos.varlen.running): the
backend auto-selection picks serves every sequence (a seeded random walk over packed mixes),
the sequences run in padded groups equal to one reference call per sequence in float64
(forward and the five gradients), and a call in which no query sees a key stays in the
autograd graph."""

from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch

import relpos
from relpos.ops.native import build
from relpos.varlen import (
    cu_seqlens_from_lengths,
    explain_backends_varlen,
    relative_attention_varlen,
    running,
    select_backend_varlen,
    selection,
)

NATIVE = build.load(quiet=True) is not None
GROUPED = ("decode", "flash_regions", "bucketed", "reference")  # no packed kernel: padded groups
H = 2


def _problem(lq: list[int], lk: list[int], *, D: int = 4, Dv: int = 3, spare: list[int] | None
             = None, seed: int = 0) -> tuple[dict, dict]:
    """The packed call's tensors (``spare[s]`` NaN rows after sequence s's keys, with
    ``seqused_k``) and the compact ones (every key row used) with the same values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), H, D, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), H, D, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), H, Dv, generator=g, dtype=torch.float64)
    compact = dict(query=q.requires_grad_(), key=k.requires_grad_(), value=v.requires_grad_(),
                   cu_seqlens_q=cu_seqlens_from_lengths(lq),
                   cu_seqlens_k=cu_seqlens_from_lengths(lk))
    if spare is None:
        return compact, compact
    starts = [0, *itertools.accumulate(lk)]
    packed = dict(compact, cu_seqlens_k=cu_seqlens_from_lengths(
        [S + n for S, n in zip(lk, spare, strict=True)]), seqused_k=torch.tensor(lk))
    for name, t in (("key", k), ("value", v)):
        parts = []
        for s, n in enumerate(spare):
            parts += [t.detach()[starts[s]:starts[s + 1]], t.new_full((n, H, t.shape[2]),
                                                                      float("nan"))]
        packed[name] = torch.cat(parts).requires_grad_()
    return packed, compact


def _tables(window: tuple[int, int], D: int, Dv: int, which: str, per_head: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    R, lead = window[0] + window[1] + 1, (H,) if per_head else ()
    out = {}
    if which in ("keys", "both"):
        out["rel_keys"] = torch.randn(*lead, R, D, generator=g, dtype=torch.float64,
                                      requires_grad=True)
    if which in ("values", "both"):
        out["rel_values"] = torch.randn(*lead, R, Dv, generator=g, dtype=torch.float64,
                                        requires_grad=True)
    return out


def _definition(x: dict, lq: list[int], lk: list[int], **kwargs: object) -> torch.Tensor:
    """One reference call per sequence of the compact packing, ``(Tq, H, Dv)``."""
    outs, q0, k0 = [], 0, 0
    Dv = x["value"].shape[2]
    for L, S in zip(lq, lk, strict=True):
        q, k, v = (x[n][a:a + m].transpose(0, 1).unsqueeze(0)
                   for n, a, m in (("query", q0, L), ("key", k0, S), ("value", k0, S)))
        if L and S:
            outs.append(relpos.relative_attention(q, k, v, implementation="reference",
                                                  **kwargs)[0].transpose(0, 1))
        elif L:
            outs.append(q.new_zeros(L, H, Dv))
        q0, k0 = q0 + L, k0 + S
    return torch.cat(outs) if outs else x["query"].new_zeros(0, H, Dv)


def _check_equal(out: torch.Tensor, ref: torch.Tensor, packed: dict, compact: dict,
                 tables: dict) -> None:
    """Forward and every gradient: the packed call's against the definition's (key and value
    rows past ``seqused_k`` get zero)."""
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    names = ("query", "key", "value")
    got = torch.autograd.grad((out * w).sum(), [*(packed[n] for n in names), *tables.values()],
                              allow_unused=True)
    inputs = [*(compact[n] for n in names), *tables.values()]
    want = torch.autograd.grad((ref * w).sum(), inputs, allow_unused=True) if ref.requires_grad \
        else [None] * len(inputs)  # no sequence attends anything
    used = None
    if "seqused_k" in packed:
        used = torch.zeros(packed["key"].shape[0], dtype=torch.bool)
        regions = packed["cu_seqlens_k"].tolist()
        for s, u in enumerate(packed["seqused_k"].tolist()):
            used[regions[s]:regions[s] + u] = True
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a = torch.zeros_like(b) if a is None else a  # an input no row saw
        b = torch.zeros_like(a) if b is None else b
        if i in (1, 2) and used is not None:
            assert not a[~used].any(), "a spare key row got a gradient"
            a = a[used]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


# ------------------------------------------------------------------------------------------
# Auto-selection: a backend that serves every sequence


def test_a_prefill_beside_a_decode_step_rules_out_the_decode_backend(no_native: None) -> None:
    # 4 queries over 5000 keys have the most pairs; the 100-token prefill is what the decode
    # backend (L <= 64) cannot serve.
    lq, lk = [4, 100], [5000, 100]
    packed, _ = _problem(lq, lk, D=4, Dv=4)
    t = _tables((8, 8), 4, 4, "both", False)
    kwargs = dict(max_distance=8, is_causal=True, **t)
    reasons = explain_backends_varlen(**packed, **kwargs)
    assert "L <= 64" in str(reasons["decode"]) and "sequence 1: L=100" in str(reasons["decode"])
    chosen = select_backend_varlen(**packed, **kwargs)
    assert chosen != "decode" and reasons[chosen] is None
    out = relative_attention_varlen(**packed, **kwargs)
    _check_equal(out, _definition(packed, lq, lk, **kwargs), packed, packed, t)
    with pytest.raises(RuntimeError, match=r"'decode' cannot serve this packed call: L=100"):
        relative_attention_varlen(**packed, **kwargs, implementation="decode")


def _random_mix(rng: random.Random, plain: bool) -> tuple[list[int], list[int]]:
    """A packed batch of decode steps, prefills, chunks (L < S), empty sequences and, for plain
    attention (no tables, not causal), more queries than keys."""
    kinds = ["decode", "decode", "prefill", "chunk", "empty"] + (["wide"] if plain else [])
    lq, lk = [], []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(kinds)
        if kind == "decode":
            L = rng.randint(1, 4)
            S = rng.randint(L, 300)
        elif kind == "prefill":
            L = S = rng.randint(1, 80)
        elif kind == "chunk":
            L = rng.randint(1, 70)
            S = L + rng.randint(1, 60)
        elif kind == "empty":
            L, S = 0, rng.randint(0, 5)
        else:
            L = rng.randint(1, 6)
            S = rng.randint(0, L - 1)
        lq.append(L)
        lk.append(S)
    return lq, lk


def test_random_packed_mixes_pick_a_backend_that_never_refuses(no_native: None) -> None:
    rng = random.Random(56)
    refused_decode = 0
    for step in range(30):
        is_causal = rng.random() < 0.5
        which = rng.choice(["none", "keys", "values", "both"])
        lq, lk = _random_mix(rng, plain=not is_causal and which == "none")
        window = rng.choice([(2, 2), (1, 3), (4, 0), (0, 0), (9, 9)])
        D, Dv = 4, rng.choice([4, 3])
        spare = [rng.randint(0, 3) for _ in lq] if rng.random() < 0.4 else None
        packed, compact = _problem(lq, lk, D=D, Dv=Dv, spare=spare, seed=step)
        tables = _tables(window, D, Dv, which, rng.random() < 0.5) if which != "none" else {}
        kwargs = dict(max_distance=window, is_causal=is_causal, **tables)
        context = f"step {step}: L={lq} S={lk} spare={spare} {which} causal={is_causal}"
        reasons = explain_backends_varlen(**packed, **kwargs)
        chosen = select_backend_varlen(**packed, **kwargs)
        assert reasons[chosen] is None, context
        refused_decode += "L <= 64" in str(reasons["decode"])
        ref = _definition(compact, lq, lk, **kwargs)
        _check_equal(relative_attention_varlen(**packed, **kwargs), ref, packed, compact, tables)
        for name in GROUPED:  # named: served exactly where its reason says so
            named = explain_backends_varlen(**packed, **kwargs, implementation=name)[name]
            assert named is None or reasons[name] is not None, context
            if named is None:
                out = relative_attention_varlen(**packed, **kwargs, implementation=name)
                torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=context)
            else:
                with pytest.raises(RuntimeError, match=f"'{name}' cannot serve"):
                    relative_attention_varlen(**packed, **kwargs, implementation=name)
    assert refused_decode >= 3, "the walk should meet prefills the decode backend refuses"


# ------------------------------------------------------------------------------------------
# Padded groups


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the padded calls the packed path makes, recorded as they run."""
    shapes: list[tuple[int, ...]] = []
    original = running.relative_attention

    def counted(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        shapes.append(tuple(q.shape))
        return original(q, *args, **kwargs)

    monkeypatch.setattr(running, "relative_attention", counted)
    return shapes


def test_short_sequences_share_a_few_padded_calls(no_native: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = _count_calls(monkeypatch)
    rng = random.Random(11)
    lk = [rng.randint(1, 40) for _ in range(256)]
    lq = [1 if s % 3 else min(S, rng.randint(1, 8)) for s, S in enumerate(lk)]
    packed, compact = _problem(lq, lk, spare=[rng.randint(0, 2) for _ in lk])
    tables = _tables((3, 1), 4, 3, "both", True)
    kwargs = dict(max_distance=(3, 1), is_causal=True, **tables)
    ref = _definition(compact, lq, lk, **kwargs)
    for implementation in ("bucketed", "reference", "decode", None):
        shapes.clear()
        out = relative_attention_varlen(**packed, **kwargs, implementation=implementation)
        assert 1 <= len(shapes) <= 8, (implementation, len(shapes))  # not 256 calls
        if implementation is None:  # and the gradients
            _check_equal(out, ref, packed, compact, tables)
        else:
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_long_sequences_run_alone_or_beside_their_equals(no_native: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Every sequence "long" (not worth copying): equal neighbours share a call through a view
    # of the packed tensors, the others run alone; the numbers are the same.
    monkeypatch.setattr(selection, "GATHER_MOST", 0)
    shapes = _count_calls(monkeypatch)
    lq, lk = [3, 3, 3, 1, 5, 5, 2], [9, 9, 9, 4, 5, 5, 7]
    packed, compact = _problem(lq, lk, D=4, Dv=4)
    tables = _tables((2, 2), 4, 4, "both", False)
    kwargs = dict(max_distance=2, is_causal=True, **tables)
    out = relative_attention_varlen(**packed, **kwargs, implementation="flash_regions")
    assert sorted(s[0] for s in shapes) == [1, 1, 2, 3], shapes
    _check_equal(out, _definition(compact, lq, lk, **kwargs), packed, compact, tables)


def _readers(out: torch.Tensor, leaf: torch.Tensor) -> int:
    """How many nodes of ``out``'s autograd graph read ``leaf`` directly (each builds a
    gradient of ``leaf``'s full size in the backward)."""
    seen, stack, readers = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is leaf:
                readers += 1
            stack.append(child)
    return readers


def test_many_sequences_read_each_input_once_in_the_backward(
        no_native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # One slice per sequence would give every sequence's backward a gradient of the packed
    # tensors' full size (seconds for a few hundred sequences over large caches).
    monkeypatch.setattr(selection, "GATHER_MOST", 0)  # every sequence alone or beside equals
    lk = [random.Random(3).randint(1, 9) + s % 5 for s in range(120)]
    lq = [min(S, 1 + s % 3) for s, S in enumerate(lk)]
    packed, compact = _problem(lq, lk, D=4, Dv=4, spare=[s % 2 for s in range(120)])
    table = _tables((2, 2), 4, 4, "both", False)
    out = relative_attention_varlen(**packed, max_distance=2, is_causal=True, **table)
    for name in ("query", "key", "value"):
        assert _readers(out, packed[name]) == 1, name
    _check_equal(out, _definition(compact, lq, lk, max_distance=2, is_causal=True, **table),
                 packed, compact, table)


def test_a_backend_without_key_masks_runs_sequences_alone_and_warns_once(
        no_native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # As the flash_regions backend on CUDA: no key mask, so sequences of different lengths
    # cannot share a padded call.
    original = running._unsupported_reasons

    def no_key_mask(call, names):  # type: ignore[no-untyped-def]
        if call.key_mask is not None:
            return dict.fromkeys(names, "key_mask is not supported here")
        return original(call, names)

    monkeypatch.setattr(running, "_unsupported_reasons", no_key_mask)
    monkeypatch.setattr(running, "MANY_CALLS", 4)
    monkeypatch.setattr(running, "_warned", False)
    shapes = _count_calls(monkeypatch)
    lq, lk = [1] * 6, [1, 2, 3, 4, 5, 6]
    packed, compact = _problem(lq, lk)
    with pytest.warns(RuntimeWarning, match=r"6 of 6 sequences ran one call each.*"
                                            r"key_mask is not supported here"):
        out = relative_attention_varlen(**packed, max_distance=2, implementation="bucketed")
    assert len(shapes) == 6
    _check_equal(out, _definition(compact, lq, lk, max_distance=2), packed, compact, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relative_attention_varlen(**packed, max_distance=2, implementation="bucketed")


# ------------------------------------------------------------------------------------------
# Nothing to attend: still in the autograd graph


@pytest.mark.parametrize("implementation",
                         ["reference", "bucketed", "decode", "flash_regions", "native"])
@pytest.mark.parametrize(("lq", "lk"), [([0, 0], [3, 4]), ([2, 1], [0, 0]), ([0], [0])])
def test_a_call_where_no_query_sees_a_key_stays_in_the_graph(
        implementation: str, lq: list[int], lk: list[int]) -> None:
    if implementation == "native" and not NATIVE:
        pytest.skip("the native kernels are not built here")
    packed, _ = _problem(lq, lk, D=4, Dv=4)
    table = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    tables = {} if sum(lq) > sum(lk) else dict(rel_keys=table)
    out = relative_attention_varlen(**packed, max_distance=2, implementation=implementation,
                                    **tables)
    assert out.shape == (sum(lq), H, 4) and not out.any()
    assert out.grad_fn is not None
    out.sum().backward()
    for name in ("query", "key", "value"):
        grad = packed[name].grad
        assert grad is not None and grad.shape == packed[name].shape and not grad.any(), name
    if tables:
        assert table.grad is not None and not table.grad.any()


@pytest.mark.parametrize("implementation", GROUPED)
def test_padded_groups_read_non_contiguous_views(no_native: None, implementation: str) -> None:
    """Slices of one fused QKV projection ``(T, H, 3D)`` (strided views, as a module's
    projection gives them): the padded groups equal the definition in float64, forward and the
    five gradients."""
    lq, lk, D = [3, 1, 7, 4, 1], [3, 9, 7, 4, 6], 4
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(sum(lk), H, 3 * D, generator=g, dtype=torch.float64, requires_grad=True)
    q = qkv[:sum(lq), :, :D]
    x = dict(query=q, key=qkv[:, :, D:2 * D], value=qkv[:, :, 2 * D:],
             cu_seqlens_q=cu_seqlens_from_lengths(lq), cu_seqlens_k=cu_seqlens_from_lengths(lk))
    assert not any(x[n].is_contiguous() for n in ("query", "key", "value"))
    tables = _tables((2, 1), D, D, "both", per_head=False)
    kwargs = dict(max_distance=(2, 1), is_causal=True, **tables)
    out = relative_attention_varlen(**x, implementation=implementation, **kwargs)
    _check_equal(out, _definition(x, lq, lk, **kwargs), x, x, tables)
