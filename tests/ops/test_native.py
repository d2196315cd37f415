"""The native backend (C++ kernels): exact against the reference in float64, forward and all five
gradients, for every feature it serves; attention dropout with the kernels' own mask; masks as
torch.nn hands them over; the build (cache, fallback without a compiler, RELPOS_NATIVE=0)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import relpos
from helpers import F64, assert_same_as_reference, forward_backward, make_problem, run
from relpos import _env
from relpos.ops import native
from relpos.ops.native import build, engines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_kernels_are_built_here() -> None:
    # A C++ compiler and ninja are part of the development set-up: CI builds the kernels once
    # and every native test below runs them (none is skipped for want of a build).
    assert native.available(), build.failure()
    assert build.status().built


@pytest.mark.parametrize(("L", "S"), [(1, 1), (5, 5), (7, 11), (3, 40), (70, 70), (13, 600)])
@pytest.mark.parametrize("K", [0, 1, 3, 1000])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(L: int, S: int, K: int, causal: bool) -> None:
    if L > 20 and K == 1000:
        K = 65  # wider than the band of 64-row query blocks: both far regions and the band
    p = make_problem(B=2, H=2, L=L, S=S, D=5, K=K, seed=L * 7 + S)
    assert relpos.select_backend(p.query, p.key, p.value, max_distance=K, rel_keys=p.rel_keys,
                                 is_causal=causal) == "native"
    assert_same_as_reference(p, "native", is_causal=causal)


# Forward query blocks are 256, 128 or 64 rows (fewer rows when the call has few heads), the
# backward's 128: shapes that take each, with partial last blocks and several key tiles.
BLOCK_SHAPES = [(4, 16, 260, 270), (2, 8, 520, 530), (1, 2, 200, 600)]


@pytest.mark.parametrize(("B", "H", "L", "S"), BLOCK_SHAPES)
@pytest.mark.parametrize("K", [5, 300])
@pytest.mark.parametrize("causal", [False, True])
def test_every_query_block_size_matches_reference(B: int, H: int, L: int, S: int, K: int,
                                                  causal: bool) -> None:
    p = make_problem(B=B, H=H, L=L, S=S, D=3, K=K, seed=L + K)
    key_mask = torch.rand(B, S, generator=torch.Generator().manual_seed(K)) > 0.1
    assert_same_as_reference(p, "native", is_causal=causal, key_mask=key_mask)


@pytest.mark.parametrize(("B", "H", "L", "S", "D", "K"), [
    (4, 16, 260, 270, 16, 16), (2, 8, 520, 530, 8, 64), (3, 2, 77, 93, 24, 5), (2, 3, 1, 517, 8, 7),
])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_rows_match_the_float64_reference(B: int, H: int, L: int, S: int, D: int, K: int,
                                                  causal: bool) -> None:
    """float32 runs the kernels' vector row passes (max, exp and sum, dS by segment) at every
    segment length, masked tails included; its error against float64 stays at float32's."""
    p64 = make_problem(B=B, H=H, L=L, S=S, D=D, K=K, seed=S)
    p32 = make_problem(B=B, H=H, L=L, S=S, D=D, K=K, seed=S, dtype=torch.float32)
    # the float32 key as a non-contiguous view of the same values ((B, S, H, D) memory)
    p32.key = p32.key.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    assert not p32.key.is_contiguous()
    key_mask = torch.rand(B, S, generator=torch.Generator().manual_seed(D)) > 0.2
    call = dict(is_causal=causal, key_mask=key_mask)
    out_ref, grads_ref = forward_backward(p64, "reference", **call)
    out, grads = forward_backward(p32, "native", **call)
    for name, a, b in zip(["out", "dq", "dk", "dv", "drel_keys", "drel_values"],
                          [out, *grads], [out_ref, *grads_ref], strict=True):
        err = (a.double() - b).abs().max().item()
        scale = b.abs().max().item()
        assert err <= 2e-6 * max(scale, 1.0), (name, err, scale)


@pytest.mark.parametrize("window", [(0, 0), (2, 0), (0, 3), (64, 8), (5, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_windows_and_query_start(window: tuple[int, int], causal: bool) -> None:
    left, right = window
    g = torch.Generator().manual_seed(left * 10 + right)
    q = torch.randn(2, 3, 9, 6, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(2, 3, 90, 6, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(2, 3, 90, 4, generator=g, dtype=F64, requires_grad=True)  # Dv != D
    ak = torch.randn(3, left + right + 1, 6, generator=g, dtype=F64, requires_grad=True)
    av = torch.randn(left + right + 1, 4, generator=g, dtype=F64, requires_grad=True)
    for start in (0, 40, 81):
        kw = dict(max_distance=window, rel_keys=ak, rel_values=av, is_causal=causal,
                  query_start=start)
        outs = {}
        for impl in ("reference", "native"):
            out = relpos.relative_attention(q, k, v, implementation=impl, **kw)
            outs[impl] = (out, torch.autograd.grad(out.square().sum(), (q, k, v, ak, av)))
        torch.testing.assert_close(outs["native"][0], outs["reference"][0], rtol=0, atol=1e-11)
        for a, b in zip(outs["native"][1], outs["reference"][1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("terms", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("per_head", [False, True])
def test_keys_only_values_only_and_per_head_tables(
    terms: tuple[bool, bool], per_head: bool
) -> None:
    keys, values = terms
    p = make_problem(B=2, H=3, L=9, S=12, D=4, Dv=6, K=2, per_head=per_head, keys_term=keys,
                     values_term=values, seed=3)
    for causal in (False, True):
        assert_same_as_reference(p, "native", is_causal=causal)


def test_key_mask_padding_and_rows_that_see_nothing() -> None:
    p = make_problem(B=3, H=2, L=10, S=10, D=4, K=3, seed=5)
    km = torch.ones(3, 10, dtype=torch.bool)
    km[0, 6:] = False  # padding
    km[1, :] = False  # a batch row that sees no key: zeros, zero gradients
    km[2, ::3] = False
    assert_same_as_reference(p, "native", key_mask=km)
    out, grads = forward_backward(p, "native", key_mask=km, is_causal=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))


@pytest.mark.parametrize("shape", [(3, 1, 1, 10), (1, 1, 1, 10), (10,), (3, 2, 7, 10), (7, 10),
                                   (3, 1, 7, 10)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attention_masks(shape: tuple[int, ...], kind: str) -> None:
    p = make_problem(B=3, H=2, L=7, S=10, D=4, K=2, seed=8)
    g = torch.Generator().manual_seed(len(shape))
    keep = torch.rand(shape, generator=g) > 0.3
    mask = keep if kind == "bool" else torch.randn(shape, generator=g, dtype=F64).masked_fill(
        ~keep, float("-inf"))
    assert relpos.select_backend(p.query, p.key, p.value, max_distance=2,
                                 rel_keys=p.rel_keys, attn_mask=mask) == "native"
    assert_same_as_reference(p, "native", attn_mask=mask, key_mask=torch.rand(3, 10) > 0.2)


def test_float_padding_as_nn_transformer_encoder_gives_it_stays_native(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # nn.TransformerEncoder turns a bool src_key_padding_mask into a float 0/-inf mask; the
    # modules hand it over as (B, 1, 1, S), which the kernels read as an O(B·S) key bias.
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                                   max_distance=3).double()
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(3, 11, 16, dtype=F64)
    pad = torch.zeros(3, 11, dtype=torch.bool)
    pad[0, 7:] = True
    pad[2, 4:] = True
    seen: list[tuple[object, object]] = []
    real = native.attention

    def spy(call):  # type: ignore[no-untyped-def]
        seen.append((call.attn_mask is None or call.attn_mask.dtype, call.key_mask is None))
        return real(call)

    monkeypatch.setattr(native, "attention", spy)
    native_out = encoder(x, src_key_padding_mask=pad)
    monkeypatch.setattr(native, "attention", real)
    assert len(seen) == 2
    for mod in encoder.modules():
        if isinstance(mod, relpos.RelativeMultiheadAttention):
            mod.implementation = "reference"
    ref = encoder(x, src_key_padding_mask=pad)
    valid = ~pad
    torch.testing.assert_close(native_out[valid], ref[valid], rtol=0, atol=1e-10)


def test_a_float_mask_that_requires_grad_is_refused() -> None:
    p = make_problem(B=1, H=1, L=4, S=4, D=4, K=1)
    mask = torch.zeros(4, 4, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        run(p, "native", attn_mask=mask)
    assert relpos.select_backend(p.query, p.key, p.value, max_distance=1, attn_mask=mask,
                                 rel_keys=p.rel_keys) != "native"


def test_gradcheck() -> None:
    p = make_problem(B=1, H=2, L=6, S=8, D=3, K=2, seed=4)
    km = torch.tensor([[True] * 6 + [False] * 2])

    def f(q, k, v, ak, av):  # type: ignore[no-untyped-def]
        return relpos.relative_attention(q, k, v, max_distance=2, rel_keys=ak, rel_values=av,
                                         key_mask=km, is_causal=True, implementation="native")

    assert torch.autograd.gradcheck(f, tuple(p.leaves()))


def test_opcheck() -> None:
    from relpos.ops.native import op  # noqa: F401

    p = make_problem(B=2, H=2, L=5, S=7, D=4, K=2, per_head=True, seed=2)
    kb = torch.zeros(2, 7, dtype=F64)
    kb[1, 5:] = float("-inf")
    args = (p.query, p.key, p.value, p.rel_keys, p.rel_values, kb, None, None)
    kw = dict(left=2, right=2, is_causal=True, scale=0.4, query_start=2, dropout_p=0.0)
    torch.library.opcheck(torch.ops.relpos.native_attention.default, args, kw)
    seed = native.draw_seed()
    torch.library.opcheck(torch.ops.relpos.native_attention.default,
                          (*args[:6], None, seed), {**kw, "dropout_p": 0.3})


# ------------------------------------------------------------------------------------------
# Attention dropout in the kernel


def _reference_with_mask(p, keep: torch.Tensor, dropout_p: float, **kw):  # type: ignore[no-untyped-def]
    """The definition with an explicit keep mask: ``(P * keep / (1 - p)) @ (V + aV)``."""
    L, S = p.query.shape[2], p.key.shape[2]
    index = relpos.relative_position_index(L, S, p.max_distance)
    scale = p.query.shape[-1] ** -0.5
    scores = p.query @ p.key.transpose(-1, -2)
    if p.rel_keys is not None:
        scores = scores + torch.einsum("bhld,lsd->bhls", p.query, p.rel_keys[index])
    scores = scores * scale
    if kw.get("is_causal"):
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).tril(S - L).logical_not(),
                                    float("-inf"))
    probs = torch.softmax(scores, -1) * keep / (1 - dropout_p)
    out = probs @ p.value
    if p.rel_values is not None:
        out = out + torch.einsum("bhls,lsd->bhld", probs, p.rel_values[index])
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_is_the_exposed_mask_applied_to_the_reference(causal: bool) -> None:
    p = make_problem(B=2, H=3, L=9, S=9, D=4, K=2, seed=6)
    rate = 0.3
    torch.manual_seed(123)
    out = run(p, "native", dropout_p=rate, is_causal=causal)
    torch.manual_seed(123)
    keep = native.dropout_mask(native.draw_seed(), (2, 3, 9, 9), rate)
    ref = _reference_with_mask(p, keep, rate, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    up = torch.randn_like(out)
    got = torch.autograd.grad(out, p.leaves(), up)
    want = torch.autograd.grad(ref, p.leaves(), up)
    for a, b in zip(got, want, strict=True):  # the backward regenerates the same mask
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_dropout_is_reproducible_and_drops_the_right_share() -> None:
    p = make_problem(B=2, H=2, L=16, S=16, D=4, K=2, seed=7)
    torch.manual_seed(5)
    a = run(p, "native", dropout_p=0.4)
    torch.manual_seed(5)
    b = run(p, "native", dropout_p=0.4)
    c = run(p, "native", dropout_p=0.4)  # the generator moved on: another mask
    assert torch.equal(a, b) and not torch.equal(a, c)
    keep = native.dropout_mask(torch.tensor([11, 22]), (4, 8, 64, 256), 0.4)
    share = 1 - keep.double().mean().item()
    assert abs(share - 0.4) < 0.005, share  # 524288 draws: 5 sigma is under 0.004
    # neighbouring rows, heads and keys are not correlated
    assert abs((keep[:, :, 1:] == keep[:, :, :-1]).double().mean().item() - 0.52) < 0.01
    assert native.dropout_mask(torch.tensor([1, 2]), (1, 1, 3, 5), 0.0).all()


def test_dropout_gradcheck() -> None:
    p = make_problem(B=1, H=2, L=5, S=6, D=3, K=1, seed=9)

    def f(q, k, v, ak, av):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)  # the same mask at every evaluation
        return relpos.relative_attention(q, k, v, max_distance=1, rel_keys=ak, rel_values=av,
                                         dropout_p=0.25, implementation="native")

    assert torch.autograd.gradcheck(f, tuple(p.leaves()))


def test_modules_train_with_default_dropout_on_the_native_backend() -> None:
    mha = relpos.RelativeMultiheadAttention(16, 2, dropout=0.1, batch_first=True, max_distance=4)
    x = torch.randn(2, 9, 16)
    q = torch.randn(2, 2, 9, 8)
    assert relpos.select_backend(q, q, q, max_distance=4, dropout_p=0.1,
                                 rel_keys=mha.rel_keys) == "native"
    y, _ = mha(x, x, x, need_weights=False)
    y.sum().backward()
    assert mha.rel_keys.grad is not None and torch.isfinite(mha.rel_keys.grad).all()


# ------------------------------------------------------------------------------------------
# Precision, determinism, layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_error_is_within_the_bucketed_backends(dtype: torch.dtype) -> None:
    p64 = make_problem(B=2, H=2, L=40, S=40, D=16, K=4, seed=11)
    low = make_problem(B=2, H=2, L=40, S=40, D=16, K=4, seed=11, dtype=dtype)
    truth = run(p64, "reference", is_causal=True)
    errors = {impl: (run(low, impl, is_causal=True).double() - truth).abs().max().item()
              for impl in ("native", "bucketed")}
    if dtype == torch.float32:
        assert errors["native"] < 1e-5, errors
    else:
        assert errors["native"] <= 2 * errors["bucketed"], errors


def test_backward_is_deterministic() -> None:
    p = make_problem(B=3, H=4, L=33, S=33, D=8, K=3, dtype=torch.float32, seed=1)
    first = forward_backward(p, "native", is_causal=True)[1]
    second = forward_backward(p, "native", is_causal=True)[1]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_cache_step_matches_the_full_sequence() -> None:
    p = make_problem(B=2, H=2, L=12, S=12, D=4, K=3, seed=10)
    full = run(p, "reference", is_causal=True)
    for t in (1, 4):
        step = relpos.relative_attention(
            p.query[:, :, -t:], p.key, p.value, max_distance=3, rel_keys=p.rel_keys,
            rel_values=p.rel_values, is_causal=True, implementation="native")
        torch.testing.assert_close(step, full[:, :, -t:], rtol=0, atol=1e-12)
        assert relpos.select_backend(p.query[:, :, -t:], p.key, p.value, max_distance=3,
                                     rel_keys=p.rel_keys, is_causal=True) == "native"


def test_plain_attention_equals_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 700, 8, generator=g, dtype=F64) for _ in range(3))
    for causal in (False, True):
        out = relpos.relative_attention(q, k, v, max_distance=4, is_causal=causal,
                                        implementation="native")
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------
# The build: cache, RELPOS_NATIVE=0, no compiler


def test_turned_off_with_relpos_native_0(no_native: None) -> None:
    p = make_problem(B=1, H=1, L=4, S=4, D=4, K=1)
    assert relpos.select_backend(p.query, p.key, p.value, max_distance=1,
                                 rel_keys=p.rel_keys) != "native"
    with pytest.raises(RuntimeError, match="RELPOS_NATIVE=0"):
        run(p, "native")
    assert_same_as_reference(p, "bucketed")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env={**os.environ, **env}, cwd=ROOT, timeout=300)


def test_without_a_compiler_one_warning_and_the_other_backends_serve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = """
        import warnings, torch, relpos
        q = torch.randn(1, 2, 9, 4, dtype=torch.float64)
        t = torch.randn(5, 4, dtype=torch.float64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            name = relpos.select_backend(q, q, q, max_distance=2, rel_keys=t)
            out = relpos.relative_attention(q, q, q, max_distance=2, rel_keys=t, rel_values=t)
            relpos.relative_attention(q, q, q, max_distance=2, rel_keys=t)
        ref = relpos.relative_attention(q, q, q, max_distance=2, rel_keys=t, rel_values=t,
                                        implementation="reference")
        assert name != "native", name
        assert torch.allclose(out, ref, atol=1e-12)
        native = [w for w in caught if "native CPU kernels could not be built" in str(w.message)]
        assert len(native) == 1, [str(w.message) for w in caught]
        print("fallback ok")
    """
    done = _python(code, CXX=str(tmp_path / "no-such-compiler"),
                   RELPOS_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fallback ok" in done.stdout


def test_a_built_cache_loads_without_compiling() -> None:
    assert build.status().built
    directory = build.build_directory()
    assert torch.__version__.replace("+", "_") in directory.name and build.isa() in directory.name
    done = _python("""
        import time, torch
        from relpos.ops.native import build
        start = time.perf_counter()
        assert build.load() is not None
        print(f"{time.perf_counter() - start:.3f}")
    """)
    assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr
    assert float(done.stdout.strip()) < 10.0


def test_relpos_kernels_cli(capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.cli import main

    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "native kernels: built" in out and build.isa() in out and "cache:" in out
    # the 16-bit GEMMs it names are those the loaded kernels found (their build_info)
    module = build.load()
    assert module is not None
    line = next(x for x in out.splitlines() if x.startswith("16-bit GEMMs:"))
    # bfloat16: the engine the loaded kernels run a bfloat16 call on now is the one named
    engine = module.bf16_gemm()
    named = {"amx": "AMX tiles", "avx512bf16": "VDPBF16PS", "mkl": "cblas_gemm_bf16bf16f32",
             "widened": "bfloat16 tiles widened to float32"}
    assert named[engine] in line, (line, engine)
    if engine == "amx":  # no hedging where the kernels have the tiles
        assert "VDPBF16PS" not in line and "cblas" not in line, line
    assert "float16 tiles widened to float32" in line  # float16's default
    # the vector code it names is the loaded kernels' (vectors= of their build_info)
    vectors = build.build_facts(module)["vectors"]
    line = next(x for x in out.splitlines() if x.startswith("vector code:"))
    want = {"avx512": "AVX-512 (", "avx2": "AVX2 (", "none": "none ("}[vectors]
    assert line.removeprefix("vector code:").strip().startswith(want), (line, vectors)


def test_relpos_kernels_cli_names_the_half_gemm_switch(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    for name in ("RELPOS_NATIVE_BF16_GEMM", "RELPOS_NATIVE_HALF_GEMM", "RELPOS_NATIVE_AMX"):
        monkeypatch.delenv(name, raising=False)
    from relpos.cli import main

    monkeypatch.setenv("RELPOS_NATIVE_HALF_GEMM", "0")
    assert main(["kernels"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("16-bit"))
    assert line.count("tiles widened to float32") == 2, line
    monkeypatch.setenv("RELPOS_NATIVE_HALF_GEMM", "1")
    monkeypatch.setenv("RELPOS_NATIVE_AMX", "0")
    assert main(["kernels"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("16-bit"))
    assert "AMX" not in line and "bfloat16 cblas_gemm_bf16bf16f32" in line, line
    monkeypatch.delenv("RELPOS_NATIVE_AMX")
    for engine, named in (("mkl", "cblas_gemm_bf16bf16f32"),
                          ("widened", "bfloat16 tiles widened to float32")):
        monkeypatch.setenv("RELPOS_NATIVE_BF16_GEMM", engine)
        assert main(["kernels"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("16-bit"))
        assert named in line, line
    monkeypatch.delenv("RELPOS_NATIVE_BF16_GEMM")
    assert main(["kernels"]) == 0
    default = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("16-bit"))
    # a name it does not know: ignored with one warning that names those allowed, the
    # default engine serves (as the kernels then run it)
    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.setenv("RELPOS_NATIVE_BF16_GEMM", " TPU ")
    with pytest.warns(RuntimeWarning) as caught:
        assert main(["kernels"]) == 0
        assert main(["kernels"]) == 0
    said = [str(w.message) for w in caught if "BF16_GEMM" in str(w.message)]
    assert said == ["relpos: RELPOS_NATIVE_BF16_GEMM=' TPU ' is none of amx, avx512bf16, mkl, "
                    "widened (or unset); it is ignored: bfloat16 calls run on the default "
                    "engine."], said
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("16-bit")]
    assert lines == [default, default], (lines, default)
    monkeypatch.setenv("RELPOS_NATIVE_BF16_GEMM", " Widened ")  # spaces and capitals: read
    assert main(["kernels"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("16-bit"))
    assert "bfloat16 tiles widened to float32" in line, line


def test_relpos_kernels_cli_refuses_to_build_when_off(no_native: None, capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.cli import main

    assert main(["kernels", "--build"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RELPOS_NATIVE=0" in err


@pytest.mark.slow
def test_the_backend_tests_pass_without_the_native_kernels() -> None:
    # The fallback stays correct: the backend tests once more with the kernels turned off.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/ops",
         "tests/test_functional.py", "tests/test_cache.py", "-k", "not native and not triton"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RELPOS_NATIVE": "0"},
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


def test_why_not_fused_names_the_native_kernels() -> None:
    p = make_problem(B=1, H=1, L=4, S=4, D=4, K=1)
    with pytest.warns(DeprecationWarning, match="use relpos.explain_backends"):
        reason = relpos.why_not_fused(p.query, p.key, p.value, max_distance=1,
                                      rel_keys=p.rel_keys)
    assert reason is not None and "native CPU kernels serve this call" in reason


def test_the_build_state_is_a_constant_for_torch_compile() -> None:
    # relpos.ops.native marks _state as torch.compiler.assume_constant_result would, without
    # importing torch._dynamo at import time: the public decorator must set the same marker.
    def probe() -> str:
        return ""

    marked = torch.compiler.assume_constant_result(probe)
    for state in (native._state, native._scalar_rows):
        assert {k: v for k, v in vars(marked).items()} == {k: v for k, v in vars(state).items()}


@pytest.mark.parametrize(("cpu", "serving", "named"), [
    ("amx", None, "bfloat16 AMX tiles"),  # this CPU's own build
    ("amx", "amx", "bfloat16 AMX tiles"),  # the prebuilt amx variant
    ("amx", "avx512", "bfloat16 cblas_gemm_bf16bf16f32"),  # MKL runs it on the tiles
    ("zen4", None, "bfloat16 VDPBF16PS on packed tiles (every tile GEMM) if this CPU runs it "
                   "faster than float32 FMAs (timed once per process), else tiles widened"),
    ("zen4", "avx512bf16", "bfloat16 VDPBF16PS on packed tiles (every tile GEMM) if this CPU "
                           "runs it faster than float32 FMAs (timed once per process), else "
                           "tiles widened"),  # the prebuilt avx512bf16 variant
    ("zen4", "avx512", "bfloat16 tiles widened to float32"),
    ("amx", "avx512bf16", "bfloat16 VDPBF16PS on packed tiles (every tile GEMM) if this CPU "
                          "runs it faster than float32 FMAs (timed once per process), else "
                          "cblas_gemm_bf16bf16f32"),
    ("avx512", None, "bfloat16 tiles widened to float32"),
])
def test_the_16bit_line_names_the_engine_of_the_cpu_and_the_build_that_serves(
        cpu: str, serving: str | None, named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``relpos kernels`` predicts for bfloat16 without loading the kernels, on a CPU
    with AMX, one with AVX512-BF16 only (AMD Zen 4) and one with plain AVX-512, for this CPU's
    own build and for a prebuilt variant: the rules of the kernels' bf16_gemm()."""
    from relpos.ops.native import build

    v4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    flags = {"amx": v4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
             "zen4": v4 | {"avx512_bf16"}, "avx512": v4}[cpu]
    for name in ("RELPOS_NATIVE_BF16_GEMM", "RELPOS_NATIVE_HALF_GEMM", "RELPOS_NATIVE_AMX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(engines, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(engines, "have_blas", lambda: True)
    monkeypatch.setattr(engines, "_exported", lambda symbol: True)
    monkeypatch.setattr(engines, "_amx_granted", lambda: True)
    monkeypatch.setattr(engines.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(engines.platform, "system", lambda: "Linux")
    line = build.half_gemms(serving)
    assert line.startswith(named), line
    assert line.endswith("; float16 tiles widened to float32"), line


@pytest.mark.parametrize(("cpu", "serving", "want", "named"), [
    ("avx512", None, "", "float32 on the kernels' AVX-512 vectors"),  # this CPU's own build
    ("avx2", None, "", "float32 MKL's sgemm_ (RELPOS_NATIVE_SGEMM=vec: the kernels' AVX2"),
    ("avx2", None, "vec", "float32 on the kernels' AVX2 vectors"),
    ("avx512", "avx2", "", "float32 MKL's sgemm_ (RELPOS_NATIVE_SGEMM=vec"),  # a prebuilt variant
    ("avx512", "avx2", "vec", "float32 on the kernels' AVX2 vectors"),
    ("avx512", "baseline", "", "float32 MKL's sgemm_;"),  # no vectors in that build
    ("sse", None, "", "float32 MKL's sgemm_;"),
    ("avx512", None, "blas", "float32 MKL's sgemm_;"),
    ("avx512", None, "vec", "float32 on the kernels' AVX-512 vectors"),
    ("avx512", None, " Blas", "float32 MKL's sgemm_;"),  # spaces and capitals: read
    ("avx512", None, "mkl", "float32 on the kernels' AVX-512 vectors"),  # unknown: the default
])
def test_the_gemm_line_names_where_the_native_float32_gemms_run(
        cpu: str, serving: str | None, want: str, named: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``relpos kernels`` predicts for the float32 GEMMs without loading the kernels: the
    kernels' own vectors where the build serving this CPU has AVX-512 (AVX2's only under
    RELPOS_NATIVE_SGEMM=vec), MKL's sgemm_ under RELPOS_NATIVE_SGEMM=blas or without them;
    float64 always on MKL's dgemm_. A value it does not know is ignored with one warning."""
    monkeypatch.setattr(_env, "_warned", set())
    v3 = {"avx", "avx2", "fma"}
    flags = {"avx512": v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
             "avx2": v3, "sse": {"sse4_2"}}[cpu]
    monkeypatch.setenv("RELPOS_NATIVE_SGEMM", want)
    monkeypatch.setattr(engines, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(engines, "have_blas", lambda: True)
    monkeypatch.setattr(engines.platform, "machine", lambda: "x86_64")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = build.float_gemms(serving)
        build.float_gemms(serving)
    assert line.startswith(named), line
    assert line.endswith("; float64 MKL's dgemm_ (libtorch's)"), line
    said = [str(w.message) for w in caught]
    assert said == ([] if want.strip().lower() in ("", "vec", "blas") else
                    [f"relpos: RELPOS_NATIVE_SGEMM={want!r} is none of vec, blas (or unset); it "
                     "is ignored: float32 GEMMs run where this build runs them by default."]), said


@pytest.mark.parametrize(("cpu", "serving", "exported", "route", "vectors"), [
    ("avx512", "baseline", False, "", False), ("sse", None, False, "", False),
    ("avx2", None, False, "", False), ("avx512", None, False, "", True),
    ("avx512", "avx512", False, "", True), ("avx512", None, True, "aten", True),
    ("avx2", None, True, "aten", False), ("avx512", None, True, "blas", True)])
def test_the_gemm_line_names_libtorchs_matrix_multiply_without_an_exported_blas(
        cpu: str, serving: str | None, exported: bool, route: str, vectors: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libtorch exports no ``sgemm_``/``dgemm_`` (or RELPOS_NATIVE_BLAS=aten asks) the
    GEMMs not on the kernels' vectors run on libtorch's own matrix multiply, and the line says
    so for float32 and float64; RELPOS_NATIVE_BLAS=blas keeps MKL's."""
    v3 = {"avx", "avx2", "fma"}
    flags = {"avx512": v3 | {"avx512f"}, "avx2": v3, "sse": {"sse4_2"}}[cpu]
    monkeypatch.delenv("RELPOS_NATIVE_SGEMM", raising=False)
    monkeypatch.setenv("RELPOS_NATIVE_BLAS", route)
    monkeypatch.setattr(engines, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(engines, "have_blas", lambda: exported)
    monkeypatch.setattr(engines.platform, "machine", lambda: "x86_64")
    line = build.float_gemms(serving)
    aten = "libtorch's matrix multiply (at::addmm, the BLAS torch.mm runs on)"
    if route == "blas":
        assert line.endswith("; float64 MKL's dgemm_ (libtorch's)"), line
        return
    assert line.startswith("float32 on the kernels' AVX-512 vectors" if vectors else
                           f"float32 {aten}"), line
    assert line.endswith(f"; float64 {aten}"), line


@pytest.mark.parametrize(("machine", "cpu", "serving", "named"), [
    ("x86_64", "avx512", None, "AVX-512 ("), ("x86_64", "avx2", None, "AVX2 ("),
    ("x86_64", "sse", None, "none"), ("x86_64", "avx512", "baseline", "none"),
    ("x86_64", "avx512", "avx2", "AVX2 ("), ("aarch64", "sse", None, "none")])
def test_the_vector_code_line_says_how_far_auto_selection_takes_kernels_without_it(
        machine: str, cpu: str, serving: str | None, named: str,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    v3 = {"avx", "avx2", "fma"}
    flags = {"avx512": v3 | {"avx512f"}, "avx2": v3, "sse": {"sse4_2"}}[cpu]
    monkeypatch.setattr(engines, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(engines.platform, "machine", lambda: machine)
    line = build.vector_code(serving)
    assert line.startswith(named), line
    assert (line == "none (compiled C++ loops)") == (named == "none"), line
    # relpos kernels adds how far auto-selection takes kernels without vector code
    from relpos.cli import main

    monkeypatch.setattr(build, "vector_code", lambda serving=None: line)
    assert main(["kernels"]) == 0
    printed = next(x for x in capsys.readouterr().out.splitlines()
                   if x.startswith("vector code:"))
    assert printed.endswith("at most 512 keys, the PyTorch backends beyond") == (named == "none")


def test_the_gemm_line_ignores_a_blas_route_it_does_not_know_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.delenv("RELPOS_NATIVE_BLAS", raising=False)
    default = build.float_gemms()
    monkeypatch.setenv("RELPOS_NATIVE_BLAS", "openblas")
    with pytest.warns(RuntimeWarning, match="RELPOS_NATIVE_BLAS='openblas' is none of aten, "
                                            "blas \\(or unset\\); it is ignored: the GEMMs run on "
                                            "MKL's sgemm_/dgemm_ where libtorch exports them"):
        assert build.float_gemms() == default
    monkeypatch.setenv("RELPOS_NATIVE_BLAS", "ATEN ")  # spaces and capitals: read
    assert "float64 libtorch's matrix multiply" in build.float_gemms()


def test_native_float32_gemms_run_where_the_kernels_say_and_on_the_blas_when_asked() -> None:
    """The loaded kernels' build_info names the float32 GEMMs ``relpos kernels`` predicts;
    under RELPOS_NATIVE_SGEMM=blas they run on MKL (build_info says so) and the float32 call
    stays within float32's error of the float64 reference, both directions; a name that is
    neither is ignored with one warning naming those allowed."""
    code = """
        import torch, relpos
        from relpos.ops.native import build
        info = build.load().build_info()
        print(info)
        print("predicted:", build.status().blas)
        g = torch.Generator().manual_seed(3)
        args = [torch.randn(2, 3, 37, 24, generator=g, dtype=torch.float64) for _ in range(3)]
        tabs = [torch.randn(11, 24, generator=g, dtype=torch.float64) for _ in range(2)]
        def run(dtype, impl):
            x = [a.to(dtype).requires_grad_() for a in args + tabs]
            out = relpos.relative_attention(*x[:3], max_distance=5, rel_keys=x[3],
                                            rel_values=x[4], implementation=impl)
            out.square().sum().backward()
            return [out.double()] + [a.grad.double() for a in x]
        for a, b in zip(run(torch.float32, "native"), run(torch.float64, "reference")):
            assert (a - b).abs().max() <= 2e-5 * max(b.abs().max(), 1.0), (a - b).abs().max()
        print("close")
    """
    default = _python(code, RELPOS_NATIVE_SGEMM="")
    assert default.returncode == 0, default.stderr
    info = default.stdout.splitlines()[0]
    predicted = default.stdout.splitlines()[1].removeprefix("predicted: ")
    on_vectors = predicted.startswith("float32 on the kernels'")
    assert ("sgemm=vec" in info) == on_vectors, (info, predicted)
    if build.isa().endswith("AVX512") and build.status().serving is None:
        assert "sgemm=vec" in info, info
    blas = _python(code, RELPOS_NATIVE_SGEMM="blas")
    assert blas.returncode == 0, blas.stderr
    assert "sgemm=blas" in blas.stdout and "close" in blas.stdout, blas.stdout
    # a name that is neither: ignored with one warning, the default GEMMs serve (the kernels
    # never see it: before, every float32 call raised)
    unknown = _python(code, RELPOS_NATIVE_SGEMM="mkl")
    assert unknown.returncode == 0, unknown.stderr[-3000:]
    assert unknown.stdout.splitlines()[0] == info and "close" in unknown.stdout, unknown.stdout
    assert unknown.stderr.count("RELPOS_NATIVE_SGEMM='mkl' is none of vec, blas") == 1, \
        unknown.stderr[-2000:]


def test_native_build_info_names_the_vector_code_built_for_this_cpu() -> None:
    """``vectors=`` in build_info: AVX-512 where this CPU has it, AVX2 + FMA next, none (plain
    loops) on other CPUs; the decode step reads it to leave plain-loop kernels alone."""
    from relpos._sysinfo import cpu_flags
    from relpos.models.decoding import _vectorized

    if build.status().serving is not None:
        pytest.fail("the tests load the kernels built for this CPU, not a prebuilt variant")
    flags = cpu_flags() or frozenset()
    x86 = build.isa().startswith(("x86_64", "AMD64"))
    want = ("avx512" if x86 and "avx512f" in flags else
            "avx2" if x86 and {"avx2", "fma"} <= flags else "none")
    module = build.load()
    info = module.build_info()
    assert f" vectors={want} " in info, info
    assert _vectorized(module) == (want != "none")


def test_auto_selection_takes_native_kernels_without_vector_code_up_to_512_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels without vector code (``vectors=none``: a build for a CPU other than x86-64's,
    or the baseline variant) are picked by auto-selection for calls of at most
    SCALAR_MAX_KEYS keys, padded and packed (by the packed call's longest sequence), and
    passed by beyond with the reason; kernels with vector code at every length; asked for by
    name they serve any call, exactly."""
    from relpos.ops import native as native_ops

    assert native_ops.SCALAR_MAX_KEYS == 512
    module = build.load()
    scalar = "blas=aten amx=none avx512bf16=none sgemm=blas vectors=none half_gemm=none"
    table = torch.randn(5, 8, dtype=torch.float64)
    kw = dict(max_distance=2, rel_keys=table, rel_values=table)

    def padded(S: int) -> tuple[Tensor, Tensor, Tensor]:
        return (torch.randn(1, 2, 3, 8, dtype=torch.float64),
                *(torch.randn(1, 2, S, 8, dtype=torch.float64) for _ in range(2)))

    def packed(*lengths: int) -> dict[str, object]:
        total = sum(lengths)
        cu = torch.tensor([0, *itertools.accumulate(lengths)])
        return dict(query=torch.randn(total, 2, 8, dtype=torch.float64),
                    key=torch.randn(total, 2, 8, dtype=torch.float64),
                    value=torch.randn(total, 2, 8, dtype=torch.float64),
                    cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)

    for info in (scalar, scalar.replace("vectors=none", "vectors=avx512")):
        monkeypatch.setattr(module, "build_info", lambda i=info: i)
        on_scalar = info == scalar
        for S in (9, 512, 513):
            q, k, v = padded(S)
            passed = on_scalar and S > 512
            assert (relpos.select_backend(q, k, v, **kw) == "native") != passed, (info, S)
            reason = relpos.explain_backends(q, k, v, **kw)["native"]
            assert (reason is not None and "no vector code" in str(reason)
                    and f"S={S} keys" in str(reason)) == passed, (S, reason)
        for lengths in ((5, 512, 7), (5, 513, 7)):
            call = packed(*lengths)
            passed = on_scalar and max(lengths) > 512
            assert (relpos.select_backend_varlen(**call) == "native") != passed, lengths
            reason = relpos.explain_backends_varlen(**call)["native"]
            assert (reason is not None and "no vector code" in reason) == passed, reason
    monkeypatch.setattr(module, "build_info", lambda: scalar)
    q, k, v = padded(600)
    # asked for by name: served, the reference's result
    torch.testing.assert_close(
        relpos.relative_attention(q, k, v, **kw, implementation="native"),
        relpos.relative_attention(q, k, v, **kw, implementation="reference"))
    assert relpos.select_backend(q, k, v, **kw, implementation="native") == "native"
    assert relpos.select_backend_varlen(**packed(5, 600, 7), implementation="native") \
        == "native"
