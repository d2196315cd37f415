"""The native backend (C++ kernels): exact against the reference in float64, forward and all five
gradients, for every feature it serves; attention dropout with the kernels' own mask; masks as
torch.nn hands them over; the build (cache, fallback without a compiler, RELPOS_NATIVE=0)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import relpos
from helpers import F64, assert_same_as_reference, forward_backward, make_problem, run
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
@pytest.mark.parametrize("engine", engines.FLOAT_ENGINES)
def test_float32_rows_match_the_float64_reference(B: int, H: int, L: int, S: int, D: int, K: int,
                                                  causal: bool, engine: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 runs the kernels' vector row passes (max, exp and sum, dS by segment) at every
    segment length, masked tails included, its GEMMs on each engine RELPOS_NATIVE_FLOAT_GEMM
    selects (the kernels' vectors, libtorch's brgemm; the one-query call's products reading K
    transposed on the BLAS); its error against float64 stays at float32's."""
    monkeypatch.setenv("RELPOS_NATIVE_FLOAT_GEMM", engine)
    module = build.load()
    assert module is not None
    if build.has_vectors(module):  # (without vectors every float32 GEMM is brgemm's)
        assert build.gemm_engines(module)["float32"] == engine
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


def _gemm_lines(out: str) -> tuple[str, str]:
    lines = dict(x.split(":", 1) for x in out.splitlines() if x.startswith(("GEMMs:", "16-bit")))
    return lines["GEMMs"].strip(), lines["16-bit GEMMs"].strip()


def test_relpos_kernels_cli(capsys) -> None:  # type: ignore[no-untyped-def]
    from relpos.cli import main

    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "native kernels: built" in out and build.isa() in out and "cache:" in out
    # the GEMM engines it names are those the loaded kernels say a call runs on now
    module = build.load()
    assert module is not None
    said = build.gemm_engines(module)
    wide, half = _gemm_lines(out)
    assert wide.startswith(f"float32 {said['float32']} (") and f"; float64 {said['float64']} (" \
        in wide, (wide, said)
    assert half.startswith(f"bfloat16 {said['bfloat16']} (") and "; float16 widened (tiles " \
        "widened to float32)" in half, (half, said)
    # the vector code it names is the loaded kernels' (vectors= of their build_info)
    vectors = build.build_facts(module)["vectors"]
    line = next(x for x in out.splitlines() if x.startswith("vector code:"))
    want = {"avx512": "AVX-512 (", "avx2": "AVX2 (", "none": "none ("}[vectors]
    assert line.removeprefix("vector code:").strip().startswith(want), (line, vectors)


def test_relpos_kernels_cli_follows_the_gemm_switches(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """What ``relpos kernels`` names changes with the switches, as the kernels' answer does."""
    from relpos.cli import main

    for name in engines.GEMM_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    module = build.load()
    assert module is not None
    for name, values in engines.GEMM_SWITCHES.items():
        dtype = "float32" if name == engines.FLOAT_GEMM_ENV else "bfloat16"
        for value in values:
            monkeypatch.setenv(name, value.upper())  # spaces and capitals: read
            ran = build.gemm_engines(module)[dtype]
            assert main(["kernels"]) == 0
            wide, half = _gemm_lines(capsys.readouterr().out)
            line = wide if dtype == "float32" else half
            assert line.startswith(f"{dtype} {ran} ({engines.ENGINE_NAMES[ran]})"), (value, line)
        monkeypatch.delenv(name)


def test_relpos_kernels_says_not_built_where_no_kernels_are(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Without a build (and no --build) there is no engine to name: it says so, no guess."""
    done = subprocess.run([sys.executable, "-m", "relpos", "kernels"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "RELPOS_CACHE_DIR": str(tmp_path / "cache"),
                               "RELPOS_KERNELS_DIR": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "native kernels: not built yet" in done.stdout, done.stdout
    wide, half = _gemm_lines(done.stdout)
    assert wide == half == ("not built (the kernels choose at each call, and say which once "
                            "built)"), done.stdout
    assert not (tmp_path / "cache" / "kernels").exists() or not any(
        (tmp_path / "cache" / "kernels").rglob("*.so"))  # nothing was built to find out


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
    assert f" vectors={want}" in info, info
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
    scalar = "blas=aten amx=none avx512bf16=none brgemm=f32 vectors=none"
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
