"""The native kernels at their edges, against the reference in float64: non-finite table rows
and rows that see no key, windows far wider than the sequence (eager and compiled), results
that do not depend on the thread count, and calls from several Python threads at once (the
kernels release the GIL)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import relpos
from helpers import F64

NAMES = ("out", "dq", "dk", "dv", "drel_keys", "drel_values")


def _forward_backward(
    implementation: str, leaves: list[torch.Tensor], upstream: torch.Tensor, **call: object
) -> list[torch.Tensor]:
    """out and the gradients of query, key, value, rel_keys and rel_values."""
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    q, k, v, rk, rv = leaves
    out = relpos.relative_attention(q, k, v, rel_keys=rk, rel_values=rv,
                                    implementation=implementation, **call)  # type: ignore[arg-type]
    grads = torch.autograd.grad(out, leaves, upstream)
    return [out.detach(), *grads]


# ------------------------------------------------------------------------------------------
# A non-finite table row and the rows that do not see it


def _hiding_masks(kind: str, B: int, H: int, L: int, S: int) -> dict[str, torch.Tensor]:
    """Batch row 1 sees no key at all; batch row 0 hides its first and last three keys, so some
    of its rows see no key at the table's first or last offset, and in the dense case query 1
    of head 0 sees nothing either."""
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1] = False
    keep[0, :3] = False
    keep[0, -3:] = False
    if kind == "key_mask":
        return {"key_mask": keep}
    if kind == "padding_attn_mask":  # (B, 1, 1, S): read by the kernels as a key bias
        return {"attn_mask": keep[:, None, None, :]}
    dense = keep[:, None, None, :].expand(B, H, L, S).clone()
    dense[0, 0, 1] = False
    return {"attn_mask": dense}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("row", [0, 2, 4])
@pytest.mark.parametrize("kind", ["key_mask", "padding_attn_mask", "dense_attn_mask"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_non_finite_table_row_stays_out_of_rows_that_do_not_see_it(
    value: float, row: int, kind: str, causal: bool
) -> None:
    """A non-finite entry in row ``row`` of rel_keys: rows that see no key at all give zeros,
    and every output and gradient entry is NaN only where the reference's is, and otherwise
    equals it (hidden keys at that offset, far or in the band, must not bring it in)."""
    B, H, L, S, D, K = 2, 2, 8, 12, 3, 2
    g = torch.Generator().manual_seed(row)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=F64) for n in (L, S, S))
    rk, rv = (torch.randn(2 * K + 1, D, generator=g, dtype=F64) for _ in range(2))
    rk[row, 0] = value
    upstream = torch.randn(B, H, L, D, generator=g, dtype=F64)
    call = dict(max_distance=K, is_causal=causal, **_hiding_masks(kind, B, H, L, S))
    ref = _forward_backward("reference", [q, k, v, rk, rv], upstream, **call)
    got = _forward_backward("native", [q, k, v, rk, rv], upstream, **call)
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))  # batch row 1 sees nothing
    assert torch.equal(got[0].isnan(), ref[0].isnan())
    for name, a, b in zip(NAMES, got, ref, strict=True):
        extra = a.isnan() & ~b.isnan()
        assert not extra.any(), f"{name}: NaN where the reference has none at {extra.nonzero()}"
        torch.testing.assert_close(a[~b.isnan()], b[~b.isnan()], rtol=0, atol=1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # The rows of batch 0 that see the non-finite row are NaN there too (not swallowed).
    assert ref[0][0].isnan().any() == got[0][0].isnan().any()


@pytest.mark.parametrize("what", ["rel_keys", "rel_values"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_rows_that_see_no_key_give_zeros_and_zero_gradients_whatever_the_tables_hold(
    what: str, dropout_p: float
) -> None:
    B, H, L, S, D, K = 2, 2, 6, 9, 4, 2
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(B, H, n, D, generator=g, dtype=F64, requires_grad=True)
              for n in (L, S, S)]
    tables = {name: torch.randn(2 * K + 1, D, generator=g, dtype=F64)
              for name in ("rel_keys", "rel_values")}
    for r in range(2 * K + 1):
        tables[what][r, r % D] = (float("nan"), float("inf"), float("-inf"))[r % 3]
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[1] = False
    out = relpos.relative_attention(*leaves, max_distance=K, **tables, key_mask=key_mask,
                                    dropout_p=dropout_p, implementation="native")
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=g,
                                                                 dtype=F64))
    for t in (out, dq, dk, dv):
        assert torch.equal(t[1], torch.zeros_like(t[1]))


def test_a_nan_query_row_in_float32_is_nan_and_leaves_the_other_rows_alone() -> None:
    """The kernels' own float32 exp meets NaN (and +-inf through the scores) in that row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (40, 70, 70))
    rk, rv = torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g)
    call = dict(max_distance=3, rel_keys=rk, rel_values=rv, implementation="native")
    clean = relpos.relative_attention(q, k, v, **call)  # type: ignore[arg-type]
    for bad in (float("nan"), float("inf"), float("-inf")):
        q2 = q.clone()
        q2[0, 1, 5, 2] = bad
        out = relpos.relative_attention(q2, k, v, **call)  # type: ignore[arg-type]
        assert out[0, 1, 5].isnan().all()
        others = torch.ones(2, 40, dtype=torch.bool)
        others[1, 5] = False
        assert torch.equal(out[0][others], clean[0][others])


# ------------------------------------------------------------------------------------------
# Windows far wider than the sequence

HUGE = [10**9, 10**30, 2**62]


def _window_problem() -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=F64) for n in (5, 9, 9))
    return [q, k, v], torch.randn(2, 2, 5, 4, generator=g, dtype=F64)


def _attend(max_distance: object, causal: bool) -> Callable[..., torch.Tensor]:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return relpos.relative_attention(q, k, v, max_distance=max_distance,  # type: ignore[arg-type]
                                         is_causal=causal, implementation="native")
    return f


@pytest.mark.parametrize("K", HUGE)
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_windows_far_wider_than_the_sequence(K: int, window: bool, compiled: bool) -> None:
    import torch._dynamo

    leaves, upstream = _window_problem()
    max_distance = (K, 1) if window else K
    causal = not window
    f = _attend(max_distance, causal)
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    ins = [t.clone().requires_grad_(True) for t in leaves]
    out = f(*ins)
    got = [out.detach(), *torch.autograd.grad(out, ins, upstream)]
    ins = [t.clone().requires_grad_(True) for t in leaves]
    ref_out = relpos.relative_attention(*ins, max_distance=max_distance, is_causal=causal,
                                        implementation="reference")
    want = [ref_out.detach(), *torch.autograd.grad(ref_out, ins, upstream)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    if compiled:
        torch._dynamo.reset()


@pytest.mark.parametrize(("left", "right"), [(2**63 - 1, 2**63 - 1), (2**63 - 1, 0),
                                             (0, 2**63 - 1), (2**62, 2**62)])
@pytest.mark.parametrize("query_start", [0, 4])
def test_the_kernels_narrow_any_window_without_tables(left: int, right: int,
                                                      query_start: int) -> None:
    """Called directly, the op takes any int64 window; without tables it changes nothing."""
    from relpos.ops.native import op  # noqa: F401  (registers the op)

    (q, k, v), _ = _window_problem()
    for causal in (False, True):
        out, _lse = torch.ops.relpos.native_attention(
            q, k, v, None, None, None, None, None, left=left, right=right, is_causal=causal,
            scale=0.5, query_start=query_start, dropout_p=0.0)
        want = relpos.relative_attention(q, k, v, max_distance=0, is_causal=causal, scale=0.5,
                                         query_start=query_start, implementation="reference")
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_the_kernels_refuse_a_window_that_does_not_match_the_tables() -> None:
    from relpos.ops.native import op  # noqa: F401  (registers the op)

    (q, k, v), _ = _window_problem()
    rk = torch.randn(1, 5, 4, dtype=F64)
    for left, right in ((2, 3), (2**63 - 1, 2**63 - 1), (-1, 5), (6, -1)):
        with pytest.raises(RuntimeError, match="window"):
            torch.ops.relpos.native_attention(
                q, k, v, rk, None, None, None, None, left=left, right=right, is_causal=False,
                scale=0.5, query_start=4, dropout_p=0.0)


# ------------------------------------------------------------------------------------------
# Threads: bitwise the same at every thread count, and from several Python threads at once


def _problem32(B: int, H: int, L: int, S: int, seed: int) -> tuple[list[torch.Tensor],
                                                                    torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    D, K = 128, 6
    leaves = [torch.randn(B, H, L, D, generator=g), torch.randn(B, H, S, D, generator=g),
              torch.randn(B, H, S, D, generator=g), torch.randn(H, 2 * K + 1, D, generator=g),
              torch.randn(2 * K + 1, D, generator=g)]
    return leaves, torch.randn(B, H, L, D, generator=g)


def _native32(leaves: list[torch.Tensor], upstream: torch.Tensor,
              causal: bool = False) -> list[torch.Tensor]:
    return _forward_backward("native", leaves, upstream, max_distance=6, is_causal=causal)


@pytest.fixture
def restore_threads():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("B", "H"), [(1, 1), (1, 2), (3, 1)])
@pytest.mark.parametrize(("L", "S"), [(4, 900), (20, 300), (150, 150)])
@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_the_same_at_one_and_two_threads(B: int, H: int, L: int, S: int, causal: bool,
                                                 restore_threads: None) -> None:
    leaves, upstream = _problem32(B, H, L, S, seed=B * 10 + H + L)
    torch.set_num_threads(1)
    one = _native32(leaves, upstream, causal)
    torch.set_num_threads(2)
    two = _native32(leaves, upstream, causal)
    for name, a, b in zip(NAMES, one, two, strict=True):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max()} between 1 and 2 threads"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("B", "H", "L", "S"), [(1, 1, 300, 300), (2, 3, 40, 500)])
def test_half_precision_bitwise_the_same_at_one_and_two_threads(
        dtype: torch.dtype, B: int, H: int, L: int, S: int, restore_threads: None) -> None:
    """The 16-bit paths too (each task's GEMMs on one thread, dk / dv per head)."""
    leaves, upstream = _problem32(B, H, L, S, seed=L + S)
    leaves, upstream = [t.to(dtype) for t in leaves], upstream.to(dtype)
    torch.set_num_threads(1)
    one = _native32(leaves, upstream, causal=True)
    torch.set_num_threads(2)
    two = _native32(leaves, upstream, causal=True)
    for name, a, b in zip(NAMES, one, two, strict=True):
        assert a.dtype == dtype and torch.equal(a, b), f"{name} differs between 1 and 2 threads"


def test_calls_from_several_python_threads_give_the_serial_results(restore_threads: None) -> None:
    torch.set_num_threads(2)
    problems = [_problem32(B, H, L, S, seed=i) for i, (B, H, L, S) in
                enumerate([(1, 1, 64, 400), (2, 3, 100, 100), (1, 2, 7, 700), (3, 1, 90, 130)])]
    serial = [_native32(*p) for p in problems]

    def work(i: int, results: list[list[torch.Tensor] | BaseException | None]) -> None:
        try:
            results[i] = _native32(*problems[i])
        except BaseException as err:  # reported below
            results[i] = err

    for _ in range(3):
        results: list[list[torch.Tensor] | BaseException | None] = [None] * len(problems)
        threads = [threading.Thread(target=work, args=(i, results))
                   for i in range(len(problems))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for want, got in zip(serial, results, strict=True):
            assert isinstance(got, list), got
            for name, a, b in zip(NAMES, got, want, strict=True):
                assert torch.equal(a, b), name


def _run_beside_a_spinning_thread(call: Callable[[], object]) -> tuple[float, float, list[float]]:
    """Runs ``call`` while another Python thread records time stamps as fast as it can;
    returns the call's start and end and the stamps."""
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 16 == 0:
                stamps.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.02)
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        stop.set()
        spinner.join()
    return start, end, stamps


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_kernels_release_the_gil(direction: str, restore_threads: None) -> None:
    """While one long kernel call runs, another Python thread keeps running: it leaves time
    stamps well inside the call (progress, not speed: robust on a busy machine)."""
    from relpos.ops.native import op

    torch.set_num_threads(1)
    options: dict[str, Any] = dict(left=8, right=8, is_causal=False, scale=0.125, query_start=0,
                                   dropout_p=0.0)
    margin = 0.02  # four times the interpreter's switch interval (5 ms)
    g = torch.Generator().manual_seed(0)
    for heads in (4, 8, 16, 32):  # until one call lasts long enough on this machine
        q, k, v = (torch.randn(1, heads, 3072, 64, generator=g) for _ in range(3))
        out, lse = op.forward(q, k, v, None, None, None, None, None, **options)
        if direction == "forward":
            call = functools.partial(op.forward, q, k, v, None, None, None, None, None, **options)
        else:
            call = functools.partial(op._backward, out, q, k, v, None, None, None, None, None,
                                     out, lse, **options)
        start, end, stamps = _run_beside_a_spinning_thread(call)
        if end - start > 8 * margin:
            break
    assert end - start > 4 * margin, f"the call took only {end - start:.3f} s"
    inside = [s for s in stamps if start + margin < s < end - margin]
    assert inside, f"no Python thread ran during the {end - start:.2f} s kernel call"
