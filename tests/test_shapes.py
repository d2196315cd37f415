"""Shapes at the edges and symbolic shapes: empty calls, clip distances far beyond the
sequence, one compiled graph for many lengths, exported graphs with a dynamic length."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import relpos
from helpers import F64

LENGTHS = (5, 9, 13, 17, 20, 24, 31, 40, 47, 55, 63, 70)  # 12 lengths


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


EMPTY = [(2, 0, 3, 7), (0, 2, 3, 7), (2, 2, 0, 7), (2, 2, 3, 0), (2, 0, 7, 7)]


@pytest.mark.parametrize("implementation", relpos.available_backends())
@pytest.mark.parametrize(("B", "H", "L", "S", "relative"),
                         [(*shape, False) for shape in EMPTY]
                         + [(*shape, True) for shape in EMPTY if shape[2] <= shape[3]])
def test_every_backend_serves_empty_calls(implementation, B, H, L, S, relative):
    q = torch.randn(B, H, L, 4, dtype=F64, requires_grad=True)
    k = torch.randn(B, H, S, 4, dtype=F64, requires_grad=True)
    tables = dict(rel_keys=torch.randn(5, 4, dtype=F64), rel_values=torch.randn(5, 4, dtype=F64))
    kw = dict(max_distance=2, **(tables if relative else {}))
    out = relpos.relative_attention(q, k, k, implementation=implementation, **kw)
    assert out.shape == (B, H, L, 4)
    assert torch.equal(out, torch.zeros_like(out))  # rows that see no key are zeros
    gq, gk = torch.autograd.grad(out.sum(), (q, k), allow_unused=True, materialize_grads=True)
    assert gq.shape == q.shape and gk.shape == k.shape
    assert not gq.any() and not gk.any()


@pytest.mark.parametrize("implementation", relpos.available_backends())
def test_backends_agree_on_what_they_serve_without_positions(implementation):
    # No tables, not causal: more queries than keys is plain attention, served by all.
    q, k = torch.randn(2, 3, 6, 4, dtype=F64), torch.randn(2, 3, 4, 4, dtype=F64)
    if implementation == "decode":  # decode serves at most MAX_QUERIES, any alignment here
        assert relpos.select_backend(q, k, k, max_distance=2, implementation="decode")
    got = relpos.relative_attention(q, k, k, max_distance=2, implementation=implementation)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("implementation", relpos.available_backends())
def test_clip_distance_beyond_the_sequence_builds_nothing_of_its_size(implementation):
    q = torch.randn(1, 2, 7, 4, dtype=F64)
    # 10**9 would need gigabytes anywhere it was taken literally: the call must be instant.
    huge = relpos.relative_attention(q, q, q, max_distance=10**9, is_causal=True,
                                     implementation=implementation)
    plain = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(huge, plain, rtol=0, atol=1e-12)
    # With tables: K = 50 over 7 keys equals the reference; the unused rows get no gradient.
    K = 50
    ak = torch.randn(2 * K + 1, 4, dtype=F64, requires_grad=True)
    av = torch.randn(2 * K + 1, 4, dtype=F64, requires_grad=True)
    kw = dict(max_distance=K, rel_keys=ak, rel_values=av)
    out = relpos.relative_attention(q[:, :, -3:], q, q, implementation=implementation, **kw)
    ref = relpos.relative_attention(q[:, :, -3:], q, q, implementation="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g_ak, g_av = torch.autograd.grad(out.sum(), (ak, av))
    want_ak, want_av = torch.autograd.grad(ref.sum(), (ak, av))
    torch.testing.assert_close(g_ak, want_ak, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_av, want_av, rtol=0, atol=1e-12)
    assert not g_ak[: K - 6].any() and not g_ak[K + 7 :].any()


@pytest.mark.parametrize("mark_dynamic", [False, True])
@pytest.mark.parametrize("implementation", [None, "bucketed", "flash_regions", "native"])
def test_module_compiles_at_most_twice_for_twelve_lengths(implementation, mark_dynamic):
    torch.manual_seed(0)
    mha = relpos.RelativeMultiheadAttention(16, 2, batch_first=True, max_distance=3,
                                            implementation=implementation, dtype=F64)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(mha, fullgraph=True, backend=counter)
    for n in LENGTHS:
        x = torch.randn(2, n, 16, dtype=F64, requires_grad=True)
        if mark_dynamic:
            torch._dynamo.mark_dynamic(x, 1)
        y, _ = compiled(x, need_weights=False, is_causal=True)
        y.sum().backward()
        want, _ = mha(x, need_weights=False, is_causal=True)
        torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 12 lengths"


@pytest.mark.parametrize("mark_dynamic", [False, True])
@pytest.mark.parametrize("implementation", [None, "bucketed", "flash_regions", "native"])
def test_functional_compiles_at_most_twice_for_twelve_lengths(implementation, mark_dynamic):
    table = torch.randn(7, 8, dtype=F64)

    def attend(q: torch.Tensor) -> torch.Tensor:
        return relpos.relative_attention(q, q, q, max_distance=3, rel_keys=table,
                                         rel_values=table, implementation=implementation)

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(attend, fullgraph=True, backend=counter)
    for n in LENGTHS:
        q = torch.randn(2, 2, n, 8, dtype=F64)
        if mark_dynamic:
            torch._dynamo.mark_dynamic(q, 2)
        torch.testing.assert_close(compiled(q), attend(q), rtol=0, atol=1e-12)
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 12 lengths"


class _UserModel(torch.nn.Module):
    """A user's own model with a relpos layer, exported with torch's API."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = relpos.RelativeTransformerEncoderLayer(
            16, 2, 32, dropout=0.0, batch_first=True, max_distance=3)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_keeps_the_length_dynamic(strict):
    torch.manual_seed(0)
    model = _UserModel().eval()
    program = torch.export.export(model, (torch.randn(2, 9, 16),),
                                  dynamic_shapes=({1: torch.export.Dim("n")},), strict=strict)
    for n in (2, 5, 40, 1100):  # across every length-dependent choice of eager mode
        x = torch.randn(2, n, 16)
        torch.testing.assert_close(program.module()(x), model(x), rtol=1e-5, atol=1e-5)


def test_onnx_export_of_a_user_model_runs_at_other_lengths(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = _UserModel().eval()
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.randn(2, 9, 16),), str(path), dynamo=True,
                      dynamic_shapes=({1: torch.export.Dim("n")},))
    session = ort.InferenceSession(str(path))
    for n in (3, 17, 50):
        x = torch.randn(2, n, 16)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        torch.testing.assert_close(torch.from_numpy(got), model(x).detach(), rtol=1e-5,
                                   atol=1e-5)
