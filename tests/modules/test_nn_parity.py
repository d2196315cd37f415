"""Every module is a drop-in for its torch.nn counterpart.

With zero relative tables and the same weights (loaded from the torch.nn module's own state
dict), each module computes what torch.nn computes, for every mask combination, layout and
weights option; a plain torch.nn state dict loads with only the relative tables missing; old
relpos state dicts (``q_proj``/``k_proj``/``v_proj``) still load.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relpos
from relpos import (
    RelativeMultiheadAttention,
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)

# torch.nn warns that mixing bool and float masks is deprecated; relpos accepts it the same way.
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning")

F64 = torch.float64
E, H, B, L, S, K = 8, 2, 3, 5, 7, 2


def _zero_tables(module: nn.Module) -> None:
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RelativeMultiheadAttention):
                for table in (m.rel_keys, m.rel_values):
                    if table is not None:
                        table.zero_()


def _relative_twin(plain: nn.Module, relative: nn.Module) -> nn.Module:
    """``relative`` with ``plain``'s weights (through its state dict) and zero tables."""
    result = relative.load_state_dict(plain.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys and all(
        k.rsplit(".", 1)[-1] in ("rel_keys", "rel_values") for k in result.missing_keys
    ), result.missing_keys
    _zero_tables(relative)
    return relative


def _seq(n: int, features: int, batch_first: bool, g: torch.Generator) -> torch.Tensor:
    shape = (B, n, features) if batch_first else (n, B, features)
    return torch.randn(shape, generator=g, dtype=F64)


def _bool_mask(rows: int, cols: int, g: torch.Generator,
               lead: tuple[int, ...] = ()) -> torch.Tensor:
    """torch.nn meaning (True = NOT allowed); column 0 always allowed (no empty rows, where
    torch.nn gives NaN and relpos zeros)."""
    m = torch.rand(*lead, rows, cols, generator=g) < 0.4
    m[..., 0] = False
    return m


def _float_mask(rows: int, cols: int, g: torch.Generator,
                lead: tuple[int, ...] = ()) -> torch.Tensor:
    m = torch.randn(*lead, rows, cols, generator=g, dtype=F64)
    return m.masked_fill(_bool_mask(rows, cols, g, lead), float("-inf"))


def _padding(cols: int, g: torch.Generator, kind: str | None) -> torch.Tensor | None:
    if kind is None:
        return None
    pad = torch.rand(B, cols, generator=g) < 0.3
    pad[:, 0] = False
    if kind == "bool":
        return pad
    return torch.zeros(B, cols, dtype=F64).masked_fill(pad, float("-inf"))


def _masks(rows: int, cols: int, g: torch.Generator) -> dict[str, torch.Tensor | None]:
    return {
        "none": None,
        "bool": _bool_mask(rows, cols, g),
        "float": _float_mask(rows, cols, g),
        "bool (B*H, L, S)": _bool_mask(rows, cols, g, (B * H,)),
        "float (B*H, L, S)": _float_mask(rows, cols, g, (B * H,)),
    }


def _close(got: object, want: object, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), what
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m: f"{what}: {m}")


# --- nn.MultiheadAttention -----------------------------------------------------------------


DIMS = {"self": (E, E, L), "cross": (E, E, S), "kdim/vdim": (5, 3, S)}


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("batch_first", [False, True])
def test_attention_with_zero_tables_equals_nn_for_every_mask(batch_first, dims):
    kdim, vdim, n_keys = DIMS[dims]
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                  dtype=F64)
    rel = _relative_twin(plain, RelativeMultiheadAttention(
        E, H, kdim=kdim, vdim=vdim, batch_first=batch_first, max_distance=K, share_heads=False,
        dtype=F64))
    g = torch.Generator().manual_seed(1)
    q = _seq(L, E, batch_first, g)
    k, v = (q, q) if dims == "self" else (_seq(n_keys, kdim, batch_first, g),
                                          _seq(n_keys, vdim, batch_first, g))
    checked = 0
    for (mask_name, mask), pad_kind, (need, avg) in itertools.product(
        _masks(L, n_keys, g).items(), (None, "bool", "float"),
        ((False, True), (True, True), (True, False)),
    ):
        pad = _padding(n_keys, g, pad_kind)
        kwargs = dict(key_padding_mask=pad, need_weights=need, attn_mask=mask,
                      average_attn_weights=avg)
        want = plain(q, k, v, **kwargs)
        got = rel(q, k, v, **kwargs)
        what = f"attn_mask={mask_name}, key_padding_mask={pad_kind}, need_weights={need}/{avg}"
        _close(got[0], want[0], what)
        _close(got[1], want[1], what + " (weights)")
        checked += 1
    assert checked == 45


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_is_causal_equals_nn_with_its_causal_mask(batch_first, need_weights):
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=F64)
    rel = _relative_twin(plain, RelativeMultiheadAttention(
        E, H, batch_first=batch_first, max_distance=K, dtype=F64))
    g = torch.Generator().manual_seed(2)
    x = _seq(L, E, batch_first, g)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    for pad_kind in (None, "bool"):
        pad = _padding(L, g, pad_kind)
        want = plain(x, x, x, key_padding_mask=pad, need_weights=need_weights,
                     attn_mask=causal, is_causal=True)
        # relpos builds the causal mask itself (torch.nn refuses is_causal without a mask) ...
        got = rel(x, x, x, key_padding_mask=pad, need_weights=need_weights, is_causal=True)
        _close(got[0], want[0], f"is_causal, key_padding_mask={pad_kind}")
        _close(got[1], want[1], "weights")
        # ... and with the mask too, is_causal is torch.nn's hint: the mask decides.
        for mask in (causal, causal.isinf()):
            got = rel(x, x, x, key_padding_mask=pad, need_weights=need_weights, attn_mask=mask,
                      is_causal=True)
            _close(got[0], want[0], f"is_causal + {mask.dtype} mask")


def test_porting_bug_triu_mask_means_blocked_as_in_nn():
    """The reported case: ``attn_mask=torch.triu(ones, 1).bool()`` from nn.MultiheadAttention
    code must give nn's (causal) result, not the opposite mask."""
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    rel = _relative_twin(plain, RelativeMultiheadAttention(
        E, H, batch_first=True, max_distance=K, dtype=F64))
    x = torch.randn(B, L, E, dtype=F64)
    mask = torch.triu(torch.ones(L, L), 1).bool()
    want, _ = plain(x, x, x, attn_mask=mask)
    got, _ = rel(x, x, x, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    causal, _ = rel(x, x, x, is_causal=True)
    torch.testing.assert_close(got, causal, rtol=0, atol=1e-12)
    # With relative terms the module still reads the mask the same way.
    rel.reset_parameters()
    torch.testing.assert_close(rel(x, x, x, attn_mask=mask)[0], rel(x, x, x, is_causal=True)[0],
                               rtol=0, atol=1e-12)


def test_defaults_signature_and_return_values_follow_nn():
    rel = RelativeMultiheadAttention(E, H, max_distance=K)
    plain = nn.MultiheadAttention(E, H)
    assert rel.batch_first is False and rel.dropout == 0.0 and rel.bias_k is None
    assert rel.add_zero_attn is False and rel._qkv_same_embed_dim
    assert isinstance(rel.out_proj, type(plain.out_proj))
    x = torch.randn(L, B, E)  # (L, B, E): batch_first=False
    out, weights = rel(x, x, x)  # need_weights=True, averaged over heads
    assert out.shape == (L, B, E) and weights is not None and weights.shape == (B, L, L)
    _, per_head = rel(x, x, x, average_attn_weights=False)
    assert per_head is not None and per_head.shape == (B, H, L, L)
    assert rel(x, x, x, need_weights=False)[1] is None
    # State dict names: nn's, plus the tables and the saved convention.
    assert set(rel.state_dict()) == set(plain.state_dict()) | {
        "rel_keys", "rel_values", "_extra_state"
    }
    separate = RelativeMultiheadAttention(E, H, kdim=3, vdim=5, max_distance=K)
    assert set(separate.state_dict()) == set(nn.MultiheadAttention(
        E, H, kdim=3, vdim=5).state_dict()) | {"rel_keys", "rel_values", "_extra_state"}
    assert separate.in_proj_weight is None and separate.k_proj_weight is not None
    no_bias = RelativeMultiheadAttention(E, H, bias=False, max_distance=K)
    assert no_bias.in_proj_bias is None and no_bias.out_proj.bias is None


def test_unbatched_input_equals_nn():
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(E, H, dtype=F64)
    rel = _relative_twin(plain, RelativeMultiheadAttention(E, H, max_distance=K, dtype=F64))
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(L, E, generator=g, dtype=F64), torch.randn(S, E, generator=g, dtype=F64)
    pad = torch.zeros(S, dtype=torch.bool)
    pad[-2:] = True
    mask = _bool_mask(L, S, g, (H,))
    for kwargs in (dict(), dict(key_padding_mask=pad, attn_mask=mask),
                   dict(average_attn_weights=False)):
        want = plain(q, k, k, **kwargs)
        got = rel(q, k, k, **kwargs)
        _close(got[0], want[0], str(kwargs))
        _close(got[1], want[1], str(kwargs))
    assert got[0].shape == (L, E)


def test_fast_path_of_nn_agrees_too():
    """In eval mode without grad, nn.MultiheadAttention takes its native fast path."""
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64).eval()
    rel = _relative_twin(plain, RelativeMultiheadAttention(
        E, H, batch_first=True, max_distance=K, dtype=F64)).eval()
    x = torch.randn(B, L, E, dtype=F64)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 3:] = True
    with torch.no_grad():
        for kwargs in (dict(need_weights=False), dict(key_padding_mask=pad)):
            want = plain(x, x, x, **kwargs)
            got = rel(x, x, x, **kwargs)
            _close(got[0], want[0], str(kwargs))
            _close(got[1], want[1], str(kwargs))


@pytest.mark.parametrize(("add_bias_kv", "add_zero_attn"), [(True, False), (False, True),
                                                            (True, True)])
def test_add_bias_kv_and_zero_attn_equal_nn_without_relative_terms(add_bias_kv, add_zero_attn):
    torch.manual_seed(0)
    opts = dict(add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, batch_first=True)
    plain = nn.MultiheadAttention(E, H, dtype=F64, **opts)
    rel = RelativeMultiheadAttention(E, H, max_distance=K, relative_keys=False,
                                     relative_values=False, dtype=F64, **opts)
    assert rel.load_state_dict(plain.state_dict()).missing_keys == []
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, L, E, generator=g, dtype=F64)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    pad = _padding(L, g, "bool")
    for kwargs in (dict(), dict(attn_mask=_bool_mask(L, L, g)),
                   dict(attn_mask=_float_mask(L, L, g), key_padding_mask=pad),
                   dict(key_padding_mask=pad, average_attn_weights=False),
                   dict(attn_mask=causal, is_causal=True)):
        # (Not need_weights=False there: torch.nn then drops the mask for SDPA's is_causal,
        # which hides the appended rows, unlike its own weights path.)
        want = plain(x, x, x, **kwargs)
        got = rel(x, x, x, **kwargs)
        _close(got[0], want[0], str(kwargs))
        _close(got[1], want[1], str(kwargs))
    # is_causal without a mask: the appended rows stay visible, as with nn's causal mask.
    want, _ = plain(x, x, x, attn_mask=causal, is_causal=True)
    _close(rel(x, x, x, is_causal=True)[0], want, "is_causal without a mask")
    # A cached step sees the rows too: decoding equals the full causal pass.
    cache = relpos.LayerCache()
    with torch.no_grad():
        steps = [rel(x[:, i : i + 1], need_weights=False, is_causal=True, cache=cache)[0]
                 for i in range(L)]
    torch.testing.assert_close(torch.cat(steps, 1), want.detach(), rtol=0, atol=1e-12)


# --- nn.TransformerEncoderLayer / nn.TransformerDecoderLayer ---------------------------------


def _layer_masks(rows: int, cols: int, g: torch.Generator) -> list[tuple[str, object, object]]:
    return [
        ("none", None, None),
        ("bool mask", _bool_mask(rows, cols, g), None),
        ("float mask + bool padding", _float_mask(rows, cols, g), _padding(cols, g, "bool")),
        ("bool padding", None, _padding(cols, g, "bool")),
        ("float padding", None, _padding(cols, g, "float")),
        ("(B*H) bool mask + bool padding", _bool_mask(rows, cols, g, (B * H,)),
         _padding(cols, g, "bool")),
    ]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_encoder_layer_with_zero_tables_equals_nn(batch_first, norm_first, activation):
    torch.manual_seed(0)
    opts = dict(dim_feedforward=16, dropout=0.0, activation=activation,
                batch_first=batch_first, norm_first=norm_first, dtype=F64)
    plain = nn.TransformerEncoderLayer(E, H, **opts)  # type: ignore[arg-type]
    rel = _relative_twin(plain, RelativeTransformerEncoderLayer(E, H, max_distance=K, **opts))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(5)
    x = _seq(L, E, batch_first, g)
    for name, mask, pad in _layer_masks(L, L, g):
        _close(rel(x, mask, pad), plain(x, mask, pad), name)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    want = plain(x, causal, None, is_causal=True)
    _close(rel(x, causal, None, is_causal=True), want, "causal mask + is_causal")
    _close(rel(x, is_causal=True), want, "is_causal without a mask")


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_decoder_layer_with_zero_tables_equals_nn(batch_first, norm_first):
    torch.manual_seed(0)
    opts = dict(dim_feedforward=16, dropout=0.0, batch_first=batch_first,
                norm_first=norm_first, dtype=F64)
    plain = nn.TransformerDecoderLayer(E, H, **opts)  # type: ignore[arg-type]
    rel = _relative_twin(plain, RelativeTransformerDecoderLayer(
        E, H, max_distance=K, relative_cross_attention=True, **opts))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(6)
    tgt, memory = _seq(L, E, batch_first, g), _seq(S, E, batch_first, g)
    for (s_name, s_mask, s_pad), (m_name, m_mask, m_pad) in zip(
        _layer_masks(L, L, g), _layer_masks(L, S, g)[::-1], strict=True
    ):
        args = (tgt, memory, s_mask, m_mask, s_pad, m_pad)
        _close(rel(*args), plain(*args), f"tgt: {s_name}, memory: {m_name}")
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    want = plain(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
    _close(rel(tgt, memory, tgt_mask=causal, tgt_is_causal=True), want, "tgt causal mask")
    _close(rel(tgt, memory, tgt_is_causal=True), want, "tgt_is_causal without a mask")


def test_inside_nn_containers_equals_nn_stacks():
    torch.manual_seed(0)
    opts = dict(dim_feedforward=16, dropout=0.0, dtype=F64)
    plain_enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **opts), 2,  # type: ignore[arg-type]
                                      norm=nn.LayerNorm(E, dtype=F64),
                                      enable_nested_tensor=False)
    rel_enc = _relative_twin(plain_enc, nn.TransformerEncoder(
        RelativeTransformerEncoderLayer(E, H, max_distance=K, **opts), 2,  # type: ignore[arg-type]
        norm=nn.LayerNorm(E, dtype=F64), enable_nested_tensor=False))
    plain_dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **opts), 2)  # type: ignore[arg-type]
    rel_dec = _relative_twin(plain_dec, nn.TransformerDecoder(
        RelativeTransformerDecoderLayer(E, H, max_distance=K, **opts), 2))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(7)
    src, tgt = _seq(S, E, False, g), _seq(L, E, False, g)
    pad = _padding(S, g, "bool")
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    memory = plain_enc(src, src_key_padding_mask=pad)
    _close(rel_enc(src, src_key_padding_mask=pad), memory, "encoder stack")
    want = plain_dec(tgt, memory, tgt_mask=causal, memory_key_padding_mask=pad)
    _close(rel_dec(tgt, memory, tgt_mask=causal, memory_key_padding_mask=pad), want,
           "decoder stack (the causal mask is detected: is_causal=True)")


# --- state dicts ---------------------------------------------------------------------------


@pytest.mark.parametrize(("plain", "relative", "missing"), [
    (lambda: nn.MultiheadAttention(E, H),
     lambda: RelativeMultiheadAttention(E, H, max_distance=K), ["rel_keys", "rel_values"]),
    (lambda: nn.MultiheadAttention(E, H, kdim=3, vdim=5, bias=False),
     lambda: RelativeMultiheadAttention(E, H, kdim=3, vdim=5, bias=False, max_distance=K,
                                        relative_values=False), ["rel_keys"]),
    (lambda: nn.TransformerEncoderLayer(E, H, 16),
     lambda: RelativeTransformerEncoderLayer(E, H, 16, max_distance=K),
     ["self_attn.rel_keys", "self_attn.rel_values"]),
    (lambda: nn.TransformerDecoderLayer(E, H, 16),
     lambda: RelativeTransformerDecoderLayer(E, H, 16, max_distance=K),
     ["self_attn.rel_keys", "self_attn.rel_values"]),
    (lambda: nn.TransformerDecoderLayer(E, H, 16),
     lambda: RelativeTransformerDecoderLayer(E, H, 16, max_distance=K,
                                             relative_cross_attention=True),
     ["self_attn.rel_keys", "self_attn.rel_values", "multihead_attn.rel_keys",
      "multihead_attn.rel_values"]),
])
def test_plain_nn_state_dict_loads_with_only_the_tables_missing(plain, relative, missing):
    source, target = plain(), relative()
    result = target.load_state_dict(source.state_dict(), strict=False)
    assert sorted(result.missing_keys) == sorted(missing)
    assert result.unexpected_keys == []
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    # The relative model keeps its meaning from then on: it saves and reloads strictly.
    again = relative()
    again.load_state_dict(target.state_dict())


def test_plain_decoder_state_dict_loads_strictly_without_relative_cross_attention():
    # Only the self-attention has tables; after they are added, strict loading works.
    source = nn.TransformerDecoderLayer(E, H, 16)
    target = RelativeTransformerDecoderLayer(E, H, 16, max_distance=K)
    state = source.state_dict()
    state.update({f"self_attn.{k}": v for k, v in target.self_attn.state_dict().items()
                  if k in ("rel_keys", "rel_values", "_extra_state")})
    # The assertion is strict loading itself: it raises on any missing or unexpected key.
    result = target.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def _old_state(module: RelativeMultiheadAttention) -> dict[str, torch.Tensor]:
    """The module's state as relpos 0.1 saved it: q_proj/k_proj/v_proj linears."""
    state = {}
    for key, value in module.state_dict().items():
        if key == "in_proj_weight":
            for name, part in zip(("q", "k", "v"), value.chunk(3), strict=True):
                state[f"{name}_proj.weight"] = part.clone()
        elif key == "in_proj_bias":
            for name, part in zip(("q", "k", "v"), value.chunk(3), strict=True):
                state[f"{name}_proj.bias"] = part.clone()
        elif key in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            state[key.replace("_weight", ".weight")] = value.clone()
        else:
            state[key] = value
    return state


@pytest.mark.parametrize("dims", [dict(), dict(kdim=3, vdim=5)])
def test_old_projection_names_are_converted_on_load(dims):
    torch.manual_seed(0)
    saved = RelativeMultiheadAttention(E, H, batch_first=True, max_distance=K, dtype=F64,
                                       **dims)
    old = _old_state(saved)
    assert "q_proj.weight" in old and not any("in_proj_weight" in k for k in old)
    fresh = RelativeMultiheadAttention(E, H, batch_first=True, max_distance=K, dtype=F64,
                                       **dims)
    fresh.load_state_dict(old)  # strict: every old key is converted, nothing is left over
    for key, value in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    x = torch.randn(B, L, E, dtype=F64)
    kv = torch.randn(B, S, dims.get("kdim", E), dtype=F64)
    vv = torch.randn(B, S, dims.get("vdim", E), dtype=F64)
    torch.testing.assert_close(fresh(x, kv, vv)[0], saved(x, kv, vv)[0], rtol=0, atol=0)
    # Nested too (a layer saved by relpos 0.1), through load_state_dict_resized as well.
    layer = RelativeTransformerEncoderLayer(E, H, 16, max_distance=K)
    old_layer = {f"self_attn.{k}": v for k, v in _old_state(layer.self_attn).items()}
    old_layer.update({k: v for k, v in layer.state_dict().items() if not k.startswith("self_")})
    twin = RelativeTransformerEncoderLayer(E, H, 16, max_distance=K + 3)
    relpos.load_state_dict_resized(twin, old_layer)
    assert torch.equal(twin.self_attn.in_proj_weight, layer.self_attn.in_proj_weight)


def test_adding_relative_positions_to_a_trained_plain_model():
    """Load the plain model, zero the tables: the same function, now trainable with relative
    positions."""
    torch.manual_seed(0)
    plain = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True).eval()
    rel = RelativeTransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True,
                                          max_distance=K).eval()
    rel.load_state_dict(plain.state_dict(), strict=False)
    _zero_tables(rel)
    x = torch.randn(B, L, E)
    torch.testing.assert_close(rel(x), plain(x), rtol=0, atol=1e-5)
    out = rel(x, is_causal=True)
    out.square().sum().backward()
    assert rel.self_attn.rel_keys is not None and rel.self_attn.rel_keys.grad is not None
    assert rel.self_attn.rel_keys.grad.abs().sum() > 0


def test_cached_steps_take_nn_masks_of_the_new_tokens():
    """A cached step takes torch.nn-meaning masks: ``key_padding_mask`` (B, t) bool of the new
    tokens (True = padding, stored with the cache) and ``attn_mask`` (t, S) (True = blocked);
    decoding equals the full pass with the same masks."""
    torch.manual_seed(0)
    mha = RelativeMultiheadAttention(E, H, batch_first=True, max_distance=K, dtype=F64).eval()
    n = 9
    x = torch.randn(B, n, E, dtype=F64)
    pad = torch.zeros(B, n, dtype=torch.bool)
    pad[1, :3] = True  # left padding
    blocked = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    blocked[:, 4] = True  # and nobody attends to position 4
    blocked[:, 0] = False
    with torch.no_grad():
        full, _ = mha(x, key_padding_mask=pad, attn_mask=blocked)
        cache = relpos.LayerCache()
        steps = [mha(x[:, :6], key_padding_mask=pad[:, :6], attn_mask=blocked[:6, :6],
                     cache=cache)[0]]
        for i in range(6, n):
            steps.append(mha(x[:, i : i + 1], attn_mask=blocked[i : i + 1, : i + 1],
                             cache=cache)[0])
    assert cache.key_mask is not None and torch.equal(cache.key_mask, ~pad)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def test_functional_api_keeps_sdpa_meanings():
    """The functional API is SDPA's: bool True = may attend (the opposite of the modules).
    (A guard: this held before the modules moved to torch.nn's meanings, and still does.)"""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(B, H, L, 4, generator=g, dtype=F64) for _ in range(3))
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    got = relpos.relative_attention(q, k, v, max_distance=K, attn_mask=allowed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
