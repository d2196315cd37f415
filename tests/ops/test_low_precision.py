"""bfloat16 / float16, native and under autocast: accuracy against a float64 truth.

Criterion (flash-attention's): for the output and every gradient, the error of a backend in a
precision is at most twice the error of the reference backend run in the same precision, plus
1e-5.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import pytest
import torch

import relpos
from relpos._sysinfo import cpu_flags
from relpos.functional import AttentionCall
from relpos.ops import flash_regions
from relpos.ops.reference import masked_softmax

F64 = torch.float64
HALF = (torch.bfloat16, torch.float16)
B, H, L, D, K = 2, 2, 96, 16, 6


@functools.cache
def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(B, H, L, D, generator=g, dtype=F64) for _ in range(3)]
    tables = [0.5 * torch.randn(2 * K + 1, D, generator=g, dtype=F64) for _ in range(2)]
    return (*qkv, *tables)


def _key_mask() -> torch.Tensor:
    km = torch.ones(B, L, dtype=torch.bool)
    km[1, :13] = False  # left padding in one sequence
    return km


@functools.cache
def _run(implementation: str, dtype: torch.dtype, mode: str, causal: bool) -> list[torch.Tensor]:
    """Output and gradients (q, k, v, rel_keys, rel_values), as float64."""
    if mode == "native":
        leaves = [t.detach().to(dtype).clone().requires_grad_(True) for t in _inputs()]
        ctx = torch.autocast("cpu", enabled=False)
    else:  # float32 tensors (activations and parameters) under autocast
        leaves = [t.detach().float().requires_grad_(True) for t in _inputs()]
        ctx = torch.autocast("cpu", dtype=dtype)
    q, k, v, rk, rv = leaves
    with ctx:
        out = relpos.relative_attention(
            q, k, v, max_distance=K, rel_keys=rk, rel_values=rv, is_causal=causal,
            key_mask=_key_mask(), implementation=implementation,
        )
    assert out.dtype == dtype
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    out.backward(grad.to(out.dtype))
    return [out.detach().double()] + [t.grad.double() for t in leaves]  # type: ignore[union-attr]


@functools.cache
def _errors(implementation: str, dtype: torch.dtype, mode: str, causal: bool) -> list[float]:
    truth = _run("reference", F64, "native", causal)
    got = _run(implementation, dtype, mode, causal)
    return [float((a - b).abs().max()) for a, b in zip(got, truth, strict=True)]


NAMES = ("out", "dq", "dk", "dv", "drel_keys", "drel_values")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", ["native", "autocast"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("implementation", ["bucketed", "flash_regions", "native"])
def test_error_at_most_twice_the_reference_in_same_precision(implementation, dtype, mode, causal):
    if implementation == "flash_regions":
        x = _inputs()[0].to(dtype)
        reason = flash_regions.unsupported_reason(AttentionCall(
            x, x, x, rel_keys=x[0, :1, : 2 * K + 1], rel_values=x[0, :1, : 2 * K + 1],
            left=K, right=K, attn_mask=None, key_mask=_key_mask(), is_causal=causal,
            dropout_p=0.0, scale=D**-0.5, query_start=0,
        ))
        if reason is not None:  # an unsupported dtype must say which one
            assert str(dtype).split(".")[-1] in reason
            with pytest.raises(RuntimeError, match="cannot serve"):
                _run(implementation, dtype, mode, causal)
            return
    ref = _errors("reference", dtype, mode, causal)
    got = _errors(implementation, dtype, mode, causal)
    for name, e, r in zip(NAMES, got, ref, strict=True):
        assert e <= 2 * r + 1e-5, f"{name}: error {e:.3g} > 2 x reference error {r:.3g} + 1e-5"
    # The criterion must be able to fail: half precision is measurably off the truth.
    assert ref[0] > 1e-4


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_softmax_statistics_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    scores = (4 * torch.randn(2, 3, 5, 700, generator=g)).to(dtype)
    keep = torch.rand(2, 1, 5, 700, generator=g) > 0.2
    keep[0, 0, 1] = False  # a row that sees nothing
    got = masked_softmax(scores, keep)
    want = torch.softmax(scores.float().masked_fill(~keep, float("-inf")), dim=-1)
    want = want.nan_to_num(0.0).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not got[0, :, 1].any()


def test_module_under_autocast_keeps_float32_parameters():
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, max_distance=3
    )
    x = torch.randn(2, 11, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, is_causal=True)
    out.float().square().sum().backward()
    attn = layer.self_attn
    assert attn.rel_keys is not None and attn.rel_keys.grad is not None
    assert attn.rel_keys.dtype == attn.rel_keys.grad.dtype == torch.float32
    want = layer(x, is_causal=True)
    torch.testing.assert_close(out.float(), want, rtol=0.05, atol=0.05)


# ------------------------------------------------------------------------------------------
# The native forward reads 16-bit inputs directly: bfloat16 with the 16-bit GEMMs (on each
# engine RELPOS_NATIVE_BF16_GEMM selects) and with its tiles widened to float32 (float16 always
# is), at shapes with several query blocks and key tiles, padded and packed.


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` inside (what the kernels read per
    call), restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


#: Where bfloat16 calls can run their GEMMs (RELPOS_NATIVE_BF16_GEMM): AMX tiles, VDPBF16PS on
#: the same packed tiles, libtorch's brgemm, tiles widened to float32 (an engine the build or
#: CPU lacks gives way to the next; the kernels' gemm_engines() says which runs).
BF16_ENGINES = ("amx", "avx512bf16", "brgemm", "widened")


def _kernels():  # type: ignore[no-untyped-def]
    from relpos.ops.native.build import load

    module = load()
    assert module is not None
    return module


def _engine_ran(engine: str) -> str:
    """The engine a bfloat16 call asking for ``engine`` runs on here, as the kernels say."""
    from relpos.ops.native.build import gemm_engines

    with _bf16_gemm(engine):
        return gemm_engines(_kernels())["bfloat16"]


def _engines_here() -> list[str]:
    """The bfloat16 engines a switch can select here (each once): those the kernels run."""
    return list(dict.fromkeys(_engine_ran(e) for e in BF16_ENGINES))


def _bf16_gemm(engine: str) -> contextlib.AbstractContextManager[None]:
    """RELPOS_NATIVE_BF16_GEMM=engine inside: bfloat16's GEMMs (forward and backward) on that
    engine (``amx``, ``avx512bf16``, ``brgemm`` or ``widened``)."""
    return _env("RELPOS_NATIVE_BF16_GEMM", engine)


def _skip_unless_here(engine: str) -> None:
    """Skip where the build or CPU lacks ``engine`` (a call asking for it runs the next)."""
    ran = _engine_ran(engine)
    if ran != engine:
        pytest.skip(f"no {engine} GEMMs here (the kernels run {ran} instead): "
                    + ("the CPU has no AMX-BF16 or Linux grants no tile state" if engine == "amx"
                       else "the build or CPU lacks them"))


def _half_case(dtype: torch.dtype, varlen: bool, causal: bool) -> tuple[float, float, float]:
    """Max error of the native forward (16-bit GEMMs on each bfloat16 engine, widened tiles),
    of the reference in ``dtype`` and the native paths' largest difference, against the float64
    truth of the rounded inputs."""
    g = torch.Generator().manual_seed(5)
    Bx, Hx, Lx, Sx, Dx, Kx = 2, 3, 300, 1100, 24, 9
    # key and value as (B, S, H, D) memory seen as (B, H, S, D): non-contiguous views
    q = torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64).to(dtype)
    k, v = (torch.randn(Bx, Sx, Hx, Dx, generator=g, dtype=F64).to(dtype).transpose(1, 2)
            for _ in range(2))
    assert not k.is_contiguous()
    rk, rv = (0.5 * torch.randn(Hx, 2 * Kx + 1, Dx, generator=g, dtype=F64).to(dtype)
              for _ in range(2))
    km = torch.rand(Bx, Sx, generator=g) > 0.1
    call = dict(max_distance=Kx, rel_keys=rk, rel_values=rv, is_causal=causal)
    if varlen:  # the same sequences packed: the batch rows' valid keys, every query
        lengths_k = km.sum(1)
        keys = [k[b][:, km[b]] for b in range(Bx)]
        vals = [v[b][:, km[b]] for b in range(Bx)]
        cu_q = torch.tensor([0, Lx, 2 * Lx])
        cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lengths_k.cumsum(0)])

        def attend(impl: str, cast: torch.dtype | None = None) -> torch.Tensor:
            c = (lambda t: t) if cast is None else (lambda t: t.to(cast))
            return relpos.relative_attention_varlen(
                c(q.transpose(1, 2).reshape(Bx * Lx, Hx, Dx)),
                c(torch.cat([t.transpose(0, 1) for t in keys])),
                c(torch.cat([t.transpose(0, 1) for t in vals])),
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_distance=Kx, rel_keys=c(rk),
                rel_values=c(rv), is_causal=causal, implementation=impl)
    else:
        def attend(impl: str, cast: torch.dtype | None = None) -> torch.Tensor:
            c = (lambda t: t) if cast is None else (lambda t: t.to(cast))
            return relpos.relative_attention(
                c(q), c(k), c(v), key_mask=km, implementation=impl,
                **{**call, "rel_keys": c(rk), "rel_values": c(rv)})  # type: ignore[arg-type]
    truth = attend("reference", F64)
    with torch.no_grad():
        outs = []
        for engine in _engines_here() if dtype == torch.bfloat16 else ["widened"]:
            with _bf16_gemm(engine):
                outs.append(attend("native"))
        ref = attend("reference")
    assert all(out.dtype == dtype for out in outs)
    err = max(float((out.double() - truth).abs().max()) for out in outs)
    apart = max(float((a.double() - b.double()).abs().max()) for a in outs for b in outs)
    return err, float((ref.double() - truth).abs().max()), apart


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_the_native_forward_reads_half_precision_within_twice_the_reference(
        dtype: torch.dtype, varlen: bool, causal: bool) -> None:
    err, ref, apart = _half_case(dtype, varlen, causal)
    assert err <= 2 * ref + 1e-5, (err, ref)
    assert ref > 1e-4  # the criterion can fail: the reference is measurably off in this type
    # the engines round P differently (16-bit GEMM) or not (widened tiles), nothing more
    assert apart <= 2 * ref, apart


@pytest.mark.parametrize("tables", ["shared", "per-head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    # B, H, L, S, D, Dv, K: whole 16 x 32 tiles (D = 64: a power-of-two scale, the tiles
    # stored straight into the scores and accumulator); the same with edge tiles; odd sizes
    # everywhere (partial row, column and k tiles, odd D for the pair packing, a scale that is
    # no power of two); a window past the sequence
    [(2, 3, 96, 640, 64, 64, 16), (2, 2, 77, 301, 64, 48, 8), (1, 2, 45, 1030, 33, 40, 5),
     (2, 2, 130, 130, 32, 17, 70)],
    ids=["whole-tiles", "edges", "odd", "wide-window"])
def test_the_native_bfloat16_forward_on_each_engine_within_twice_the_reference(
        shape: tuple[int, ...], causal: bool, tables: str) -> None:
    """The bfloat16 forward's four GEMMs (scores, QA, P V, Pb aV) on AMX tiles, on VDPBF16PS
    over the same packed tiles, on libtorch's brgemm and on widened tiles (each the build and
    the CPU have): each within twice the reference's own bfloat16 error of the float64 truth,
    and within that of each other."""
    Bx, Hx, Lx, Sx, Dx, Dvx, Kx = shape
    g = torch.Generator().manual_seed(11)
    q = torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64).bfloat16()
    k = torch.randn(Bx, Hx, Sx, Dx, generator=g, dtype=F64).bfloat16()
    v = torch.randn(Bx, Hx, Sx, Dvx, generator=g, dtype=F64).bfloat16()
    lead = (Hx,) if tables == "per-head" else ()
    rk = (0.5 * torch.randn(*lead, 2 * Kx + 1, Dx, generator=g, dtype=F64)).bfloat16()
    rv = (0.5 * torch.randn(*lead, 2 * Kx + 1, Dvx, generator=g, dtype=F64)).bfloat16()

    def attend(impl: str, cast: torch.dtype | None = None) -> torch.Tensor:
        c = (lambda t: t) if cast is None else (lambda t: t.to(cast))
        with torch.no_grad():
            return relpos.relative_attention(c(q), c(k), c(v), max_distance=Kx, rel_keys=c(rk),
                                             rel_values=c(rv), is_causal=causal,
                                             implementation=impl)

    truth = attend("reference", F64)
    ref = float((attend("reference").double() - truth).abs().max())
    assert ref > 1e-4  # the criterion can fail: the reference is measurably off in bfloat16
    outs = []
    for engine in _engines_here():
        with _bf16_gemm(engine):
            outs.append(attend("native"))
    for out in outs:
        assert out.dtype == torch.bfloat16
        err = float((out.double() - truth).abs().max())
        assert err <= 2 * ref + 1e-5, (err, ref)
    assert max(float((a.double() - b.double()).abs().max()) for a in outs for b in outs) <= 2 * ref


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_native_bfloat16_varlen_forward_on_each_engine_with_short_sequences(
        causal: bool) -> None:
    """Packed sequences from one query (a single row of a 16-row tile) to several tiles, on
    each bfloat16 engine, each within twice the reference's bfloat16 error."""
    g = torch.Generator().manual_seed(3)
    Hx, Dx, Kx = 2, 64, 5
    lq, lk = [1, 3, 17, 30, 100], [1, 9, 17, 33, 100]
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()])
    q = torch.randn(sum(lq), Hx, Dx, generator=g, dtype=F64).bfloat16()
    k, v = (torch.randn(sum(lk), Hx, Dx, generator=g, dtype=F64).bfloat16() for _ in range(2))
    rk, rv = ((0.5 * torch.randn(2 * Kx + 1, Dx, generator=g, dtype=F64)).bfloat16()
              for _ in range(2))

    def attend(impl: str, cast: torch.dtype | None = None) -> torch.Tensor:
        c = (lambda t: t) if cast is None else (lambda t: t.to(cast))
        with torch.no_grad():
            return relpos.relative_attention_varlen(
                c(q), c(k), c(v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_distance=Kx,
                rel_keys=c(rk), rel_values=c(rv), is_causal=causal, implementation=impl)

    truth = attend("reference", F64)
    ref = float((attend("reference").double() - truth).abs().max())
    assert ref > 1e-4
    for engine in _engines_here():
        with _bf16_gemm(engine):
            out = attend("native")
        err = float((out.double() - truth).abs().max())
        assert err <= 2 * ref + 1e-5, (err, ref)


# ------------------------------------------------------------------------------------------
# The native backward reads 16-bit inputs directly too (q, k, v, grad_out, out), its tile GEMMs
# on 16-bit operands where libtorch has them, K and V widened per tile otherwise; dk and dv
# accumulate in float32 per head. Several query blocks and key tiles, per-head tables, a key
# mask, non-contiguous key and value, padded and packed.

GRAD_NAMES = ("dq", "dk", "dv", "drel_keys", "drel_values")


def _half_backward_case(dtype: torch.dtype, varlen: bool, causal: bool, engine: str
                        ) -> tuple[list[float], list[float]]:
    """Max error of each native gradient and of the reference's in ``dtype`` against the
    float64 truth of the rounded inputs (``engine``: what RELPOS_NATIVE_BF16_GEMM asks for;
    float16 always runs on widened tiles)."""
    g = torch.Generator().manual_seed(8)
    Bx, Hx, Lx, Sx, Dx, Kx = 2, 2, 290, 700, 24, 9
    q = torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64).to(dtype)
    k, v = (torch.randn(Bx, Sx, Hx, Dx, generator=g, dtype=F64).to(dtype).transpose(1, 2)
            for _ in range(2))
    rk, rv = (0.5 * torch.randn(Hx, 2 * Kx + 1, Dx, generator=g, dtype=F64).to(dtype)
              for _ in range(2))
    km = torch.rand(Bx, Sx, generator=g) > 0.1
    up = torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64).to(dtype)

    def grads(impl: str, cast: torch.dtype | None) -> list[torch.Tensor]:
        c = (lambda t: t) if cast is None else (lambda t: t.to(cast))
        leaves = [c(t).detach().requires_grad_(True) for t in (q, k, v, rk, rv)]
        lq, lk, lv, lrk, lrv = leaves
        if varlen:
            cu_q = torch.tensor([0, Lx, 2 * Lx])
            cu_k = torch.cat([torch.zeros(1, dtype=torch.long), km.sum(1).cumsum(0)])
            out = relpos.relative_attention_varlen(
                lq.transpose(1, 2).reshape(Bx * Lx, Hx, Dx),
                torch.cat([lk[b][:, km[b]].transpose(0, 1) for b in range(Bx)]),
                torch.cat([lv[b][:, km[b]].transpose(0, 1) for b in range(Bx)]),
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_distance=Kx, rel_keys=lrk,
                rel_values=lrv, is_causal=causal, implementation=impl)
            out = out.view(Bx, Lx, Hx, Dx).transpose(1, 2)
        else:
            out = relpos.relative_attention(
                lq, lk, lv, key_mask=km, max_distance=Kx, rel_keys=lrk, rel_values=lrv,
                is_causal=causal, implementation=impl)
        out.backward(c(up))
        for leaf in leaves:
            assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype
        return [leaf.grad.double() for leaf in leaves]  # type: ignore[union-attr]

    truth = grads("reference", F64)
    with _bf16_gemm(engine):
        got = grads("native", None)
    ref = grads("reference", None)
    err = [float((a - t).abs().max()) for a, t in zip(got, truth, strict=True)]
    ref_err = [float((a - t).abs().max()) for a, t in zip(ref, truth, strict=True)]
    return err, ref_err


@pytest.mark.parametrize(("dtype", "engine"), [
    *((torch.bfloat16, e) for e in BF16_ENGINES), (torch.float16, "widened")],
    ids=[*(f"bf16-{e}" for e in BF16_ENGINES), "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_the_native_backward_reads_half_precision_within_twice_the_reference(
        dtype: torch.dtype, varlen: bool, causal: bool, engine: str) -> None:
    if dtype == torch.bfloat16:
        _skip_unless_here(engine)
    err, ref = _half_backward_case(dtype, varlen, causal, engine)
    for name, e, r in zip(GRAD_NAMES, err, ref, strict=True):
        assert e <= 2 * r + 1e-5, f"{name}: error {e:.3g} > 2 x reference error {r:.3g} + 1e-5"
        assert r > 1e-4, (name, r)  # the criterion can fail: the reference is measurably off


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    # B, H, L, S, D, Dv, K: D = 64 (a power-of-two scale: Q scaled in its packs, dK's tiles
    # accumulated in place) with whole and with edge tiles; a scale that is no power of two
    [(1, 2, 160, 640, 64, 64, 16), (2, 2, 77, 301, 64, 48, 8), (1, 2, 45, 130, 40, 24, 5)],
    ids=["whole-tiles", "edges", "odd"])
def test_the_native_bfloat16_backward_on_each_engine_within_twice_the_reference(
        shape: tuple[int, ...], causal: bool, engine: str) -> None:
    """The bfloat16 backward's five tile GEMMs on AMX tiles, on VDPBF16PS over the same packed
    tiles, on libtorch's brgemm and on widened tiles (skipped where the build or the CPU lacks
    one): every gradient within twice the reference's bfloat16 error."""
    _skip_unless_here(engine)
    Bx, Hx, Lx, Sx, Dx, Dvx, Kx = shape
    g = torch.Generator().manual_seed(12)
    base = [torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64),
            torch.randn(Bx, Hx, Sx, Dx, generator=g, dtype=F64),
            torch.randn(Bx, Hx, Sx, Dvx, generator=g, dtype=F64),
            0.5 * torch.randn(2 * Kx + 1, Dx, generator=g, dtype=F64),
            0.5 * torch.randn(2 * Kx + 1, Dvx, generator=g, dtype=F64)]
    base = [t.bfloat16() for t in base]
    up = torch.randn(Bx, Hx, Lx, Dvx, generator=g, dtype=F64).bfloat16()

    def grads(impl: str, cast: torch.dtype | None) -> list[torch.Tensor]:
        leaves = [(t if cast is None else t.to(cast)).requires_grad_(True) for t in base]
        out = relpos.relative_attention(*leaves[:3], max_distance=Kx, rel_keys=leaves[3],
                                        rel_values=leaves[4], is_causal=causal,
                                        implementation=impl)
        return [x.double() for x in torch.autograd.grad(out, leaves, up.to(out.dtype))]

    truth = grads("reference", F64)
    ref = grads("reference", None)
    with _bf16_gemm(engine):
        got = grads("native", None)
    for name, a, r, t in zip(GRAD_NAMES, got, ref, truth, strict=True):
        e, re = float((a - t).abs().max()), float((r - t).abs().max())
        assert e <= 2 * re + 1e-5, f"{name}: error {e:.3g} > 2 x reference error {re:.3g}"
        assert re > 1e-4


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_the_native_half_backward_regenerates_the_forward_dropout(dtype: torch.dtype) -> None:
    """With dropout, the 16-bit backward against the definition with the exposed keep mask (in
    float64, and in the same 16-bit type for the error budget)."""
    from relpos.ops import native

    g = torch.Generator().manual_seed(3)
    Bx, Hx, Lx, Dx, Kx, rate = 2, 2, 150, 16, 5, 0.3
    base = [torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64).to(dtype) for _ in range(3)]
    base += [(0.5 * torch.randn(2 * Kx + 1, Dx, generator=g, dtype=F64)).to(dtype)
             for _ in range(2)]
    up = torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64).to(dtype)
    index = relpos.relative_position_index(Lx, Lx, Kx)

    def definition(leaves: list[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
        q, k, v, rk, rv = leaves
        scores = (q @ k.transpose(-1, -2)
                  + torch.einsum("bhld,lsd->bhls", q, rk[index])) * Dx**-0.5
        probs = torch.softmax(scores.double(), -1).to(q.dtype) * keep / (1 - rate)
        return probs @ v + torch.einsum("bhls,lsd->bhld", probs, rv[index])

    leaves = [t.clone().requires_grad_(True) for t in base]
    torch.manual_seed(17)
    out = relpos.relative_attention(*leaves[:3], max_distance=Kx, rel_keys=leaves[3],
                                    rel_values=leaves[4], dropout_p=rate,
                                    implementation="native")
    got = torch.autograd.grad(out, leaves, up)
    torch.manual_seed(17)
    keep = native.dropout_mask(native.draw_seed(), (Bx, Hx, Lx, Lx), rate)
    errors = []
    for cast in (F64, dtype):
        ref_leaves = [t.to(cast).requires_grad_(True) for t in base]
        want = torch.autograd.grad(definition(ref_leaves, keep), ref_leaves, up.to(cast))
        errors.append([a.double() for a in want])
    truth, ref = errors
    for name, a, t, r in zip(GRAD_NAMES, got, truth, ref, strict=True):
        e, re = float((a.double() - t).abs().max()), float((r - t).abs().max())
        assert e <= 2 * re + 1e-5, f"{name}: error {e:.3g} > 2 x reference error {re:.3g}"
        assert re > 1e-4


@pytest.fixture
def no_engine_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """No bfloat16 engine asked for (the rest of the suite follows the switch where it is)."""
    monkeypatch.delenv("RELPOS_NATIVE_BF16_GEMM", raising=False)


@pytest.mark.usefixtures("no_engine_switches")
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_the_native_default_half_gemm_path_per_type(dtype: torch.dtype) -> None:
    """bfloat16 runs on the engine the kernels' gemm_engines() names (AMX tiles, VDPBF16PS
    where it pays, brgemm where the CPU has AMX, else widened tiles), float16 on the widened
    tiles whatever the switch: the default is that engine bit for bit, and a 16-bit engine's
    bits differ from the widened tiles' (P rounded or not)."""
    from relpos.ops.native.build import gemm_engines

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 70, 16, generator=g).to(dtype) for _ in range(3))
    rk, rv = ((0.5 * torch.randn(9, 16, generator=g)).to(dtype) for _ in range(2))

    def call() -> torch.Tensor:
        with torch.no_grad():
            return relpos.relative_attention(q, k, v, max_distance=4, rel_keys=rk,
                                             rel_values=rv, implementation="native")

    default = call()
    engine = gemm_engines(_kernels())[str(dtype).removeprefix("torch.")]
    with _bf16_gemm(engine):
        assert torch.equal(call(), default)
    if dtype == torch.float16:
        assert engine == "widened"
        for other in BF16_ENGINES:  # bfloat16's switch: float16 stays on widened tiles
            with _bf16_gemm(other):
                assert torch.equal(call(), default)
        return
    with _bf16_gemm("widened"):
        wide = call()
    for other in _engines_here():
        with _bf16_gemm(other):
            assert torch.equal(call(), wide) == (other == "widened"), other


@pytest.mark.usefixtures("no_engine_switches")
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_native_short_bfloat16_query_blocks_leave_the_dot_products_for_the_next_best(
        varlen: bool) -> None:
    """Query blocks under 16 rows are too short for the VDPBF16PS tiles: such a call runs on
    widened tiles where the CPU has no AMX-BF16 (a library's bfloat16 GEMM is slower there) and
    on libtorch's brgemm where it has (oneDNN uses the tiles), both directions, bit for bit;
    longer blocks stay on the dot products (P rounded to bfloat16: their bits differ from the
    widened tiles')."""
    if _engine_ran("brgemm") != "brgemm":
        pytest.skip("no bfloat16 brgemm here (it needs AVX-512): every engine is widened")
    has_dot = _engine_ran("avx512bf16") == "avx512bf16"
    amx_cpu = "amx_bf16" in (cpu_flags() or frozenset())

    def grads(engine: str, L: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(L)  # the same inputs for every engine
        q, k, v = (torch.randn(3, 2, L, 32, generator=g).bfloat16().requires_grad_()
                   for _ in range(3))
        rk, rv = ((0.5 * torch.randn(9, 32, generator=g)).bfloat16().requires_grad_()
                  for _ in range(2))
        with _bf16_gemm(engine):
            if varlen:
                cu = torch.arange(0, 3 * L + 1, L)
                flat = [t.transpose(1, 2).reshape(3 * L, 2, 32) for t in (q, k, v)]
                out = relpos.relative_attention_varlen(
                    *flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_distance=4, rel_keys=rk,
                    rel_values=rv, implementation="native")
            else:
                out = relpos.relative_attention(q, k, v, max_distance=4, rel_keys=rk,
                                                rel_values=rv, implementation="native")
            out.float().square().sum().backward()
        return [out.detach(), *(t.grad for t in (q, k, v, rk, rv))]

    short = {e: grads(e, 9) for e in ("avx512bf16", "widened", "brgemm")}
    expected = "widened" if has_dot and not amx_cpu else "brgemm"
    for a, b in zip(short["avx512bf16"], short[expected], strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b)
                   for a, b in zip(short["widened"], short["brgemm"], strict=True))
    if has_dot:  # 40 rows: on the dot products
        dot, wide = grads("avx512bf16", 40), grads("widened", 40)
        assert not any(torch.equal(a, b) for a, b in zip(dot, wide, strict=True))


def test_an_unknown_native_bfloat16_engine_is_refused() -> None:
    """A name that is no engine: the call is refused with the names of the engines (it never
    runs on an engine other than the one asked for), every time; unset, the call runs."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 8, 16, generator=g).bfloat16() for _ in range(3))
    default = relpos.relative_attention(q, k, v, max_distance=2, implementation="native")
    with _bf16_gemm("mkl"):
        for _ in range(2):
            with pytest.raises(ValueError, match="RELPOS_NATIVE_BF16_GEMM='mkl' is none of amx, "
                                                 "avx512bf16, brgemm, widened"):
                relpos.relative_attention(q, k, v, max_distance=2, implementation="native")
    out = relpos.relative_attention(q, k, v, max_distance=2, implementation="native")
    assert torch.equal(out, default)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_the_native_half_backward_with_a_dense_float_mask(dtype: torch.dtype) -> None:
    """A dense additive mask (finite biases and -inf) in a 16-bit call, both directions,
    within twice the reference's error in that type."""
    g = torch.Generator().manual_seed(9)
    Bx, Hx, Lx, Sx, Dx, Kx = 2, 2, 140, 260, 16, 7
    base = [torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64)]
    base += [torch.randn(Bx, Hx, Sx, Dx, generator=g, dtype=F64) for _ in range(2)]
    base += [0.5 * torch.randn(2 * Kx + 1, Dx, generator=g, dtype=F64) for _ in range(2)]
    base = [t.to(dtype) for t in base]
    mask = torch.randn(Bx, 1, Lx, Sx, generator=g, dtype=F64)
    mask[torch.rand(Bx, 1, Lx, Sx, generator=g) < 0.3] = float("-inf")
    mask[..., -1] = 0.0  # every row sees a key
    up = torch.randn(Bx, Hx, Lx, Dx, generator=g, dtype=F64).to(dtype)

    def run(impl: str, cast: torch.dtype | None) -> list[torch.Tensor]:
        leaves = [(t if cast is None else t.to(cast)).detach().requires_grad_(True)
                  for t in base]
        m = mask.to(dtype if cast is None else cast)
        out = relpos.relative_attention(*leaves[:3], attn_mask=m, max_distance=Kx,
                                        rel_keys=leaves[3], rel_values=leaves[4],
                                        implementation=impl)
        grads = torch.autograd.grad(out, leaves, up if cast is None else up.to(cast))
        return [t.detach().double() for t in (out, *grads)]

    truth, got, ref = run("reference", F64), run("native", None), run("reference", None)
    for name, a, t, r in zip(NAMES, got, truth, ref, strict=True):
        e, re = float((a - t).abs().max()), float((r - t).abs().max())
        assert e <= 2 * re + 1e-5, f"{name}: error {e:.3g} > 2 x reference error {re:.3g}"
