"""torch.compile: full graphs, no recompilation per sequence length, custom-op checks.

``eager`` counts what Dynamo captures (graph breaks fail ``fullgraph=True``; fake tensors run
through every op, the flash_regions custom op's fake implementation included); ``aot_eager`` also
traces the backward with fake tensors, as Inductor does, without Inductor's slow C++ codegen.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import relpos

F64 = torch.float64
BACKENDS = ("bucketed", "flash_regions", "native")

@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters() if p.grad is not None]


def _zero(module: torch.nn.Module, x: torch.Tensor) -> None:
    x.grad = None
    module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("implementation", BACKENDS)
def test_attention_compiles_fullgraph_once_for_all_lengths(implementation):
    torch.manual_seed(0)
    mha = relpos.RelativeMultiheadAttention(
        24, 3, batch_first=True, max_distance=3, implementation=implementation, dtype=F64
    )
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(mha, fullgraph=True, backend=counter)
    lengths = (5, 8, 11, 20)
    for n in lengths:
        x = torch.randn(2, n, 24, dtype=F64, requires_grad=True)
        key_mask = torch.ones(2, n, dtype=torch.bool)
        key_mask[1, : n // 3] = False
        out, _ = compiled(x, need_weights=False, key_mask=key_mask)
        out.square().sum().backward()
        got = _grads(mha, x)
        _zero(mha, x)
        want, _ = mha(x, need_weights=False, key_mask=key_mask)
        want.square().sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for g, w in zip(got, _grads(mha, x), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        _zero(mha, x)
    # One static graph for the first length, one dynamic graph for all the others.
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for {lengths}"


@pytest.mark.parametrize(
    "implementation", BACKENDS
)
def test_encoder_layer_aot_forward_backward_dynamic(implementation):
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, max_distance=2,
        implementation=implementation, dtype=F64,
    )
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for n in (6, 9, 14):
        x = torch.randn(3, n, 16, dtype=F64, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 1)
        out = compiled(x, is_causal=True)
        out.square().sum().backward()
        got = _grads(layer, x)
        _zero(layer, x)
        want = layer(x, is_causal=True)
        want.square().sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for g, w in zip(got, _grads(layer, x), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        _zero(layer, x)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for 3 lengths"


def _rand(*shape: int, transposed: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, dtype=F64)
    if transposed:  # same shape, (B, L, H, D) memory layout as after a head split
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.requires_grad_(True)


def _fused_inputs(transposed: bool, causal: bool) -> tuple[tuple[object, ...], dict[str, object]]:
    B, H, L, S, D, K = 2, 3, 5, 7, 4, 2
    key_mask = torch.rand(B, S, generator=torch.Generator().manual_seed(0)) > 0.3
    key_mask[:, -1] = True
    return (
        _rand(B, H, L, D, transposed=transposed), _rand(B, H, S, D, transposed=transposed),
        _rand(B, H, S, D, transposed=transposed), _rand(2 * K + 1, D).unsqueeze(0),
        _rand(H, 2 * K + 1, D), key_mask,
    ), dict(left=K, right=K, is_causal=causal, scale=0.5, query_start=S - L)


@pytest.mark.parametrize(("transposed", "causal"), [(False, False), (True, True)])
def test_opcheck_fused_forward_op(transposed, causal):
    import relpos.ops.flash_regions  # noqa: F401  (registers relpos::fused_attention)

    args, options = _fused_inputs(transposed, causal)
    torch.library.opcheck(torch.ops.relpos.fused_attention.default, args, options)


def test_opcheck_fused_backward_op():
    import relpos.ops.flash_regions  # noqa: F401

    args, options = _fused_inputs(True, False)
    with torch.no_grad():
        outs = torch.ops.relpos.fused_attention(*args, **options)
    q, k, v, rk, rv, km = args
    grad_out = torch.randn_like(outs[0])
    detached = [t.detach() for t in (q, k, v, rk, rv)]  # type: ignore[union-attr]
    torch.library.opcheck(
        torch.ops.relpos.fused_attention_backward.default,
        (grad_out, *detached, km, *outs), options,
    )


@pytest.mark.parametrize("implementation", BACKENDS)
def test_decoder_layer_compiles_fullgraph_without_recompiling_per_length(implementation):
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerDecoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, max_distance=2,
        implementation=implementation, dtype=F64,
    )
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    memory = torch.randn(2, 10, 16, dtype=F64)
    for n in (4, 7, 9, 12):
        tgt = torch.randn(2, n, 16, dtype=F64, requires_grad=True)
        out = compiled(tgt, memory, tgt_is_causal=True)
        out.sum().backward()
        torch.testing.assert_close(out, layer(tgt, memory, tgt_is_causal=True), rtol=0, atol=1e-12)
    assert counter.frame_count <= 2, counter.frame_count


def test_module_called_as_nn_compiles_fullgraph_without_recompiling_per_length():
    """nn.MultiheadAttention's call: defaults (need_weights=True, (L, B, E)), masks in torch.nn's
    meanings (True = blocked / padding), converted inside the graph."""
    torch.manual_seed(0)
    mha = relpos.RelativeMultiheadAttention(16, 2, max_distance=3, dtype=F64)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(mha, fullgraph=True, backend=counter)
    for n in (5, 8, 11, 20):
        x = torch.randn(n, 2, 16, dtype=F64, requires_grad=True)
        pad = torch.zeros(2, n, dtype=torch.bool)
        pad[1, -2:] = True
        blocked = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        out, weights = compiled(x, x, x, key_padding_mask=pad, attn_mask=blocked)
        want, want_weights = mha(x, x, x, key_padding_mask=pad, attn_mask=blocked)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(weights, want_weights, rtol=1e-10, atol=1e-10)
        out.sum().backward()
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 4 lengths"


# --- windows (left, right) ------------------------------------------------------------------

# 12 lengths each. validate_call serves a window wider than the sequence as the narrowest one
# that clips nothing; under compile that comparison of the length with the window is a guard,
# so lengths on both sides of a window edge (n - 1 < left and n - 1 >= left) take one more
# graph, for K as for windows (test_window_edge_crossing_recompiles_once_more below).
WINDOW_LENGTHS = {
    (64, 8): (10, 13, 17, 20, 24, 31, 40, 47, 55, 60, 62, 64),  # left side always wider
    (0, 5): (7, 9, 13, 17, 20, 24, 31, 40, 47, 55, 63, 70),
    (5, 0): (7, 9, 13, 17, 20, 24, 31, 40, 47, 55, 63, 70),
}


@pytest.mark.parametrize("implementation", [None, *BACKENDS])
@pytest.mark.parametrize("window", list(WINDOW_LENGTHS))
def test_window_module_compiles_fullgraph_at_most_twice_for_twelve_lengths(implementation,
                                                                          window):
    torch.manual_seed(0)
    mha = relpos.RelativeMultiheadAttention(
        16, 2, batch_first=True, max_distance=window, implementation=implementation, dtype=F64
    )
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(mha, fullgraph=True, backend=counter)
    for n in WINDOW_LENGTHS[window]:
        x = torch.randn(2, n, 16, dtype=F64, requires_grad=True)
        key_mask = torch.ones(2, n, dtype=torch.bool)
        key_mask[1, : n // 3] = False
        out, _ = compiled(x, need_weights=False, key_mask=key_mask, is_causal=True)
        out.square().sum().backward()
        got = _grads(mha, x)
        _zero(mha, x)
        want, _ = mha(x, need_weights=False, key_mask=key_mask, is_causal=True)
        want.square().sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for g, w in zip(got, _grads(mha, x), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        _zero(mha, x)
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 12 lengths"


@pytest.mark.parametrize("implementation", BACKENDS)
def test_window_encoder_layer_aot_forward_backward_one_dynamic_graph(implementation):
    torch.manual_seed(0)
    layer = relpos.RelativeTransformerEncoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, max_distance=(40, 1),
        implementation=implementation, dtype=F64,
    )
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for n in (4, 9, 14, 23):
        x = torch.randn(3, n, 16, dtype=F64, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 1)
        out = compiled(x, is_causal=True)
        out.square().sum().backward()
        got = _grads(layer, x)
        _zero(layer, x)
        want = layer(x, is_causal=True)
        want.square().sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for g, w in zip(got, _grads(layer, x), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        _zero(layer, x)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for 4 lengths"


def test_window_lm_compiles_fullgraph_without_recompiling_per_length():
    from relpos.models import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=11, d_model=16, num_heads=2,
                                    max_distance=(64, 8))).to(F64).eval()
    counter = CompileCounterWithBackend("eager")
    # The models check their ids (data-dependent); compile the part past the check.
    compiled = torch.compile(lambda ids: model.logits(model.hidden(ids, None, None, True)),
                             fullgraph=True, backend=counter)
    for n in (3, 10, 30, 50, 64):
        ids = torch.randint(0, 11, (2, n))
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-10, atol=1e-10)
    assert counter.frame_count <= 2, counter.frame_count


@pytest.mark.parametrize("window", [64, (64, 8)])
def test_window_edge_crossing_compiles_at_most_twice(window):
    mha = relpos.RelativeMultiheadAttention(16, 2, batch_first=True, max_distance=window)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(mha, fullgraph=True, backend=counter)
    for n in (5, 9, 13, 40, 63, 70, 80, 90):
        compiled(torch.randn(2, n, 16), need_weights=False, is_causal=True)
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 8 lengths"
