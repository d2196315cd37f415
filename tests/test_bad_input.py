"""Bad input, table-driven: every entry names the call, the exception and a message fragment.

Covers the functional API, the modules, the KV cache, saved states and the command line (a
command-line failure is exit status 2 with one line on stderr, raised here as ``CLIFailure``).
Then the documented behaviour of non-finite values.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

import relpos
from relpos import KVCache, RelativeMultiheadAttention, relative_attention
from relpos import RelativeTransformerDecoderLayer as DecoderLayer
from relpos import RelativeTransformerEncoderLayer as EncoderLayer
from relpos.cli import main


class CLIFailure(Exception):
    """``relpos ARGS`` exited with status 2; the message is its stderr."""


def cli(*argv: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    text = err.getvalue()
    if code != 0:
        assert code == 2, f"exit status {code}"
        assert text.count("\n") == 1 and text.startswith("relpos: error: "), text
        raise CLIFailure(text)


B, H, L, S, D, K = 2, 3, 5, 7, 4, 2
Q, KEY, V = torch.randn(B, H, L, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
T = torch.randn(2 * K + 1, D)


def attn(**overrides: Any) -> Callable[[], object]:
    """``relative_attention`` with valid arguments except ``overrides``."""
    kwargs: dict[str, Any] = dict(
        query=Q, key=KEY, value=V, max_distance=K, rel_keys=T, rel_values=T
    )
    kwargs.update(overrides)
    return lambda: relative_attention(**kwargs)


def mha(**kwargs: Any) -> RelativeMultiheadAttention:
    """A batch-first attention (E = 8, H = 2, K = 2) with ``kwargs`` changed."""
    options: dict[str, Any] = dict(batch_first=True, max_distance=2)
    options.update(kwargs)
    return RelativeMultiheadAttention(8, 2, **options)


def enc(**kwargs: Any) -> EncoderLayer:
    options: dict[str, Any] = dict(dim_feedforward=16, batch_first=True, max_distance=2)
    options.update(kwargs)
    return EncoderLayer(8, 2, **options)


def dec(**kwargs: Any) -> DecoderLayer:
    options: dict[str, Any] = dict(dim_feedforward=16, batch_first=True, max_distance=2)
    options.update(kwargs)
    return DecoderLayer(8, 2, **options)


NAN, INF = float("nan"), float("inf")


def _state_with(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    """A valid attention state dict with some entries replaced."""
    return {**mha().state_dict(), **changes}


def _filled_cache() -> KVCache:
    cache = KVCache(1)
    mha()(torch.randn(2, 3, 8), cache=cache[0])
    return cache


CASES: list[tuple[str, Callable[[], object], type[BaseException], str]] = [
    # --- functional: tensors ------------------------------------------------------------
    ("query not a tensor", attn(query=[[1.0]]), TypeError, "query must be a torch.Tensor"),
    ("query 3-D", attn(query=Q[0]), ValueError, "query must be 4-D (B, H, L, D)"),
    ("integer query", attn(query=Q.long()), TypeError,
     "floating point tensor, got dtype torch.int64"),
    ("complex key", attn(key=KEY.to(torch.complex64)), TypeError, "key must be a floating point"),
    ("key dtype differs", attn(key=KEY.double()), TypeError, "share one dtype"),
    ("batch differs", attn(key=KEY[:1], value=V[:1]), ValueError, "batch sizes differ"),
    ("heads differ", attn(key=KEY[:, :2], value=V[:, :2]), ValueError, "head counts differ"),
    ("key head dim differs", attn(key=KEY[..., :3]), ValueError,
     "key head dim 3 != query head dim 4"),
    ("value length differs", attn(value=V[:, :, :6]), ValueError,
     "value has 6 positions but key has 7"),
    ("empty head dim", attn(query=Q[..., :0], key=KEY[..., :0], rel_keys=None, rel_values=None),
     ValueError, "head dim D must be >= 1"),
    ("more queries than keys", attn(query=KEY, key=Q, value=V[:, :, :5]), ValueError,
     "cannot align 7 queries to the end of 5 keys"),
    # --- functional: clip distance and tables ---------------------------------------------
    ("negative K", attn(max_distance=-1, rel_keys=None, rel_values=None), ValueError,
     "max_distance must be a non-negative int"),
    ("float K", attn(max_distance=2.0), TypeError, "max_distance must be a non-negative int"),
    ("bool K", attn(max_distance=True), TypeError, "got True of type bool"),
    ("table rows != 2K+1", attn(rel_keys=torch.randn(4, D)), ValueError,
     "rel_keys has 4 rows (shape (4, 4)), but max_distance=2 needs 2K+1 = 5"),
    ("table width != D", attn(rel_keys=torch.randn(5, 3)), ValueError,
     "rel_keys has embedding size 3"),
    ("value table width != Dv", attn(rel_values=torch.randn(5, 3)), ValueError,
     "rel_values has embedding size 3, but Dv = 4"),
    ("1-D table", attn(rel_values=torch.randn(5)), ValueError, "(2K+1, Dv) shared by all heads"),
    ("table head count", attn(rel_keys=torch.randn(2, 5, D)), ValueError,
     "rel_keys has 2 heads (shape (2, 5, 4)), allowed: shared (2-D) or one per head, H=3"),
    ("table dtype", attn(rel_keys=T.double()), TypeError, "rel_keys has dtype torch.float64"),
    # --- functional: masks and flags --------------------------------------------------------
    ("integer attn_mask", attn(attn_mask=torch.ones(L, S, dtype=torch.int32)), TypeError,
     "attn_mask must be bool (True = may attend) or floating point"),
    ("float attn_mask dtype", attn(attn_mask=torch.zeros(L, S, dtype=torch.float64)), TypeError,
     "float attn_mask has dtype torch.float64"),
    ("attn_mask (S, L)", attn(attn_mask=torch.ones(S, L, dtype=torch.bool)), ValueError,
     "attn_mask of shape (7, 5) does not broadcast to (B, H, L, S) = (2, 3, 5, 7)"),
    ("attn_mask 5-D", attn(attn_mask=torch.ones(1, B, H, L, S, dtype=torch.bool)), ValueError,
     "does not broadcast"),
    ("float key_mask", attn(key_mask=torch.ones(B, S)), TypeError, "key_mask must be bool"),
    ("key_mask (B, L)", attn(key_mask=torch.ones(B, L, dtype=torch.bool)), ValueError,
     "key_mask must have shape (B, S) = (2, 7), got (2, 5)"),
    ("is_causal=1", attn(is_causal=1), TypeError, "is_causal must be a bool, got 1"),
    ("dropout_p=1", attn(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1), got 1.0"),
    ("dropout_p str", attn(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    ("scale nan", attn(scale=float("nan")), ValueError, "scale must be finite, got nan"),
    ("scale tensor", attn(scale=torch.tensor(0.5)), TypeError, "scale must be a float or None"),
    ("query_start out of range", attn(query_start=3), ValueError,
     "allowed: 0 <= query_start <= 2 (S - L with L=5, S=7)"),
    ("query_start float, no tables", attn(query_start=1.5, rel_keys=None, rel_values=None),
     TypeError, "query_start must be an int or None, got 1.5"),
    ("unknown implementation", attn(implementation="Fused"), ValueError,
     "unknown implementation 'Fused'; allowed: None (auto), 'reference'"),
    ("flash_regions with dropout", attn(dropout_p=0.1, implementation="flash_regions"),
     RuntimeError, "implementation 'flash_regions' cannot serve this call: dropout_p=0.1"),
    ("flash_regions with Dv != D", attn(value=torch.randn(B, H, S, 6), rel_values=None,
                                        implementation="flash_regions"),
     RuntimeError, "Dv=6 differs from D=4"),
    # --- modules: construction ---------------------------------------------------------------
    ("embed_dim % heads", lambda: RelativeMultiheadAttention(10, 3, max_distance=2), ValueError,
     "embed_dim=10 is not divisible by num_heads=3"),
    ("zero heads", lambda: RelativeMultiheadAttention(8, 0, max_distance=2), ValueError,
     "num_heads must be a positive int, got 0"),
    ("module dropout 1.5", lambda: mha(dropout=1.5), ValueError, "dropout must be in [0, 1)"),
    ("module negative K", lambda: RelativeMultiheadAttention(8, 2, max_distance=-3), ValueError,
     "max_distance must be a non-negative int"),
    ("old positional K", lambda: RelativeMultiheadAttention(8, 2, 3), TypeError,
     "third positional argument, which is dropout (as in torch.nn), and no max_distance; "
     "max_distance is keyword-only: pass max_distance=3"),
    ("module without K", lambda: RelativeMultiheadAttention(8, 2), TypeError,
     "RelativeMultiheadAttention needs max_distance=K"),
    ("encoder layer without K", lambda: EncoderLayer(8, 2, 16), TypeError,
     "RelativeTransformerEncoderLayer needs max_distance=K (the clip distance"),
    ("decoder layer without K", lambda: DecoderLayer(8, 2, 16), TypeError,
     "RelativeTransformerDecoderLayer needs max_distance=K"),
    ("module K = 10**9", lambda: mha(max_distance=10**9), ValueError,
     "max_distance=1000000000 needs relative tables of 2K+1 = 2000000001 rows x 4"),
    ("per-head K = 10**8 names the limit",
     lambda: mha(max_distance=10**8, share_heads=False), ValueError,
     f"allowed: at most {1 << 28} elements, max_distance <= 16777215 for this module"),
    ("layer K = 10**9", lambda: enc(max_distance=10**9), ValueError,
     "needs relative tables of 2K+1 = 2000000001 rows"),
    ("negative kdim", lambda: mha(kdim=-1), ValueError,
     "kdim must be a positive int or None (= embed_dim), got -1"),
    ("float kdim", lambda: mha(kdim=2.7), TypeError,
     "kdim must be a positive int or None (= embed_dim), got 2.7 of type float"),
    ("str vdim", lambda: mha(vdim="8"), TypeError,
     "vdim must be a positive int or None (= embed_dim), got '8' of type str"),
    ("module unknown implementation", lambda: mha(implementation="bogus"), ValueError,
     "unknown implementation 'bogus'; allowed: None (auto), 'reference'"),
    ("str relative_keys", lambda: mha(relative_keys="no"), TypeError,
     "relative_keys must be a bool (True or False), got 'no'"),
    ("int batch_first", lambda: mha(batch_first=1), TypeError,
     "batch_first must be a bool (True or False), got 1"),
    ("add_bias_kv with tables", lambda: mha(add_bias_kv=True), ValueError,
     "add_bias_kv/add_zero_attn append key/value rows that have no position"),
    ("layer dim_feedforward -1", lambda: enc(dim_feedforward=-1), ValueError,
     "dim_feedforward must be a positive int, got -1"),
    ("layer dim_feedforward float", lambda: enc(dim_feedforward=16.0), TypeError,
     "dim_feedforward must be a positive int, got 16.0 of type float"),
    ("layer_norm_eps 0", lambda: enc(layer_norm_eps=0.0), ValueError,
     "layer_norm_eps must be a positive finite float, got 0.0"),
    ("layer norm_first str", lambda: enc(norm_first="yes"), TypeError,
     "norm_first must be a bool (True or False), got 'yes'"),
    ("layer activation", lambda: enc(activation="tanh"), ValueError,
     "activation must be 'relu', 'gelu' or a callable, got 'tanh'"),
    # --- modules: inputs ----------------------------------------------------------------------
    ("module wrong features", lambda: mha()(torch.randn(2, 5, 7)), ValueError,
     "query must have shape (B, N, F) (or (N, F) unbatched) with F=8, got (2, 5, 7)"),
    ("module input not a tensor", lambda: mha()([[0.0] * 8]), TypeError,
     "query must be a torch.Tensor, got list"),
    ("int64 input into a float32 module", lambda: mha()(torch.ones(2, 5, 8, dtype=torch.long)),
     TypeError, "query has dtype torch.int64; allowed: floating point, the module's dtype "
     "torch.float32"),
    ("float64 input into a float32 module", lambda: mha()(torch.randn(2, 5, 8).double()),
     TypeError, "query has dtype torch.float64 but the module's parameters are torch.float32; "
     "allowed: torch.float32"),
    ("float64 key into a float32 module",
     lambda: mha()(torch.randn(2, 5, 8), torch.randn(2, 5, 8).double()), TypeError,
     "key has dtype torch.float64 but the module's parameters are torch.float32"),
    ("meta input into a cpu module", lambda: mha()(torch.randn(2, 5, 8, device="meta")),
     ValueError, "query is on meta but the module's parameters are on cpu; allowed: inputs on "
     "the parameters' device"),
    ("cpu input into a meta module", lambda: mha(device="meta")(torch.randn(2, 5, 8)),
     ValueError, "query is on cpu but the module's parameters are on meta"),
    ("int64 input into a layer", lambda: enc()(torch.ones(2, 5, 8, dtype=torch.long)),
     TypeError, "src has dtype torch.int64; allowed: floating point"),
    ("float64 memory into a float32 decoder",
     lambda: dec()(torch.randn(2, 5, 8), torch.randn(2, 6, 8).double()), TypeError,
     "memory has dtype torch.float64 but the module's parameters are torch.float32"),
    ("module self-attention with kdim", lambda: mha(kdim=4)(torch.randn(2, 5, 8)), ValueError,
     "key=None (self-attention) needs kdim == embed_dim"),
    ("module key batch differs", lambda: mha()(torch.randn(2, 5, 8), torch.randn(3, 6, 8)),
     ValueError, "disagree on batch or length"),
    ("module batched query, unbatched key",
     lambda: mha()(torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6, 8)), ValueError,
     "query, key and value must all be batched (3-D) or all unbatched (2-D)"),
    ("need_weights not a bool", lambda: mha()(torch.randn(2, 5, 8), need_weights=1), TypeError,
     "need_weights must be a bool (True or False), got 1"),
    ("integer attn_mask into a module",
     lambda: mha()(torch.randn(2, 5, 8), attn_mask=torch.ones(5, 5, dtype=torch.int32)),
     TypeError, "attn_mask must be bool (True = NOT allowed, as in torch.nn) or floating point"),
    ("attn_mask (S, L) into a module",
     lambda: mha()(torch.randn(2, 5, 8), torch.randn(2, 7, 8),
                   attn_mask=torch.ones(7, 5, dtype=torch.bool)),
     ValueError, "a 2-D attn_mask must have shape (L, S) = (5, 7), got (7, 5)"),
    ("module key_padding_mask (B, L)",
     lambda: mha()(torch.randn(2, 5, 8), torch.randn(2, 7, 8),
                   key_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
     ValueError, "key_padding_mask must have shape (B, S) = (2, 7), got (2, 5)"),
    ("module key_padding_mask and key_mask",
     lambda: mha()(torch.randn(2, 5, 8), key_padding_mask=torch.zeros(2, 5, dtype=torch.bool),
                   key_mask=torch.ones(2, 5, dtype=torch.bool)),
     ValueError, "got both key_padding_mask (torch.nn's meaning, True = padding) and key_mask"),
    ("layer input not a tensor", lambda: enc()([1.0, 2.0]), TypeError,
     "src must be a torch.Tensor, got list"),
    ("layer 1-D input", lambda: enc()(torch.randn(8)), ValueError,
     "src must have shape 3-D (B, L, E) or 2-D (L, E) unbatched, got (8,)"),
    ("layer (B*H, L, S) mask size",
     lambda: enc()(torch.randn(2, 5, 8), src_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
     ValueError, "a 3-D src_mask must have shape (B * H, L, S) with B * H = 2 * 2 = 4, "
     "got (3, 5, 5)"),
    ("layer mask not a tensor", lambda: enc()(torch.randn(2, 5, 8), src_mask=[[True]]),
     TypeError, "src_mask must be a torch.Tensor or None, got list"),
    ("layer 1-D padding mask",
     lambda: enc()(torch.randn(2, 5, 8), src_key_padding_mask=torch.zeros(5, dtype=torch.bool)),
     ValueError, "src_key_padding_mask must have shape (B, S) = (2, 5), got (5,)"),
    ("layer is_causal not a bool", lambda: enc()(torch.randn(2, 5, 8), is_causal=None),
     TypeError, "is_causal must be a bool (True or False), got None"),
    ("decoder memory padding mask length",
     lambda: dec()(torch.randn(2, 5, 8), torch.randn(2, 6, 8),
                   memory_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
     ValueError, "memory_key_padding_mask must have shape (B, S) = (2, 6), got (2, 5)"),
    ("decoder memory batch", lambda: dec()(torch.randn(2, 5, 8), torch.randn(3, 6, 8)),
     ValueError, "disagree on batch or length"),
    # --- saved states -------------------------------------------------------------------------
    ("load state with other K",
     lambda: mha().load_state_dict(RelativeMultiheadAttention(8, 2, max_distance=5).state_dict()),
     relpos.RelativeStateError, "trained with max_distance=5 (11 rows) but this module has"),
    ("NaN _extra_state",
     lambda: mha().load_state_dict(_state_with(_extra_state=torch.tensor([1.0, NAN, 1, 1]))),
     relpos.RelativeStateError, "RelativeMultiheadAttention: unrecognized relpos module state "
     "[1.0, nan, 1.0, 1.0] (dtype torch.float32): its values must be whole finite numbers"),
    ("infinite _extra_state",
     lambda: mha().load_state_dict(_state_with(_extra_state=torch.tensor([1.0, INF, 1, 1]))),
     relpos.RelativeStateError, "its values must be whole finite numbers"),
    ("load_state_dict_resized with a list",
     lambda: relpos.load_state_dict_resized(mha(), list(mha().state_dict().items())),
     TypeError, "state_dict must be a mapping of names to tensors (as module.state_dict() "
     "returns), got list"),
    ("load_state_dict_resized into a non-module",
     lambda: relpos.load_state_dict_resized({}, mha().state_dict()), TypeError,
     "module must be a torch.nn.Module, got dict"),
    ("load_state_dict_resized strict='no'",
     lambda: relpos.load_state_dict_resized(mha(), mha().state_dict(), strict="no"), TypeError,
     "strict must be a bool (True or False), got 'no'"),
    # --- KV cache ---------------------------------------------------------------------------
    ("cache not a LayerCache", lambda: mha()(torch.randn(2, 5, 8), cache=KVCache(1)), TypeError,
     "cache must be a relpos.LayerCache"),
    ("cache with explicit key",
     lambda: mha()(torch.randn(2, 5, 8), torch.randn(2, 5, 8), cache=KVCache(1)[0]),
     ValueError, "cache= serves self-attention only"),
    ("cache overflow",
     lambda: mha()(torch.randn(2, 5, 8), cache=KVCache(1, capacity=4, growable=False)[0]),
     ValueError, "a fixed capacity of 4 allows at most 4 more"),
    ("cache batch changes", lambda: mha()(torch.randn(3, 1, 8), cache=_filled_cache()[0]),
     ValueError, "batch size mismatch: the cache holds 2"),
    ("cache step with a float padding mask",
     lambda: mha()(torch.randn(2, 1, 8), key_padding_mask=torch.zeros(2, 1),
                   cache=_filled_cache()[0]),
     TypeError, "key_padding_mask of a cached step must be bool (True = padding; it is stored "
     "with the cache), got dtype torch.float32"),
    ("cache step padding mask over the whole cache",
     lambda: mha()(torch.randn(2, 1, 8), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool),
                   cache=_filled_cache()[0]),
     ValueError, "key_padding_mask must have shape (B, t) = (2, 1), got (2, 4)"),
    ("cache capacity 0", lambda: KVCache(1, capacity=0), ValueError,
     "capacity must be a positive int or None, got 0"),
    ("cache truncate -1", lambda: _filled_cache()[0].truncate(-1), ValueError,
     "cannot truncate to length -1: allowed 0 <= length <= 3"),
    ("cache reorder index", lambda: _filled_cache()[0].reorder([0, 5]), IndexError,
     "batch_indices contains 5"),
    # --- resizing -----------------------------------------------------------------------------
    ("resize even rows", lambda: relpos.resize_relative_table(torch.zeros(4, 3), 2), ValueError,
     "a relative table has an odd number 2K+1 of rows"),
    # --- command line -------------------------------------------------------------------------
    ("cli unknown command", lambda: cli("bogus"), CLIFailure, "invalid choice: 'bogus'"),
    ("cli table length 0", lambda: cli("table", "--length", "0"), CLIFailure,
     "--length: must be an int >= 1, got '0'"),
    ("cli table query outside", lambda: cli("table", "--length", "10", "--query", "12"),
     CLIFailure, "allowed: 0..9"),
    ("cli heatmap too long", lambda: cli("heatmap", "--length", "100000"), CLIFailure,
     "allowed: 1..4096"),
    ("cli export missing model", lambda: cli("export-onnx", "/nonexistent/model.pt"), CLIFailure,
     "no such file or directory"),
]


def test_table_is_large_enough():
    assert len(CASES) >= 100
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize(("call", "error", "fragment"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input(call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# --- non-finite values (documented in relative_attention's docstring) ----------------------

IMPLEMENTATIONS = ("reference", "bucketed", "flash_regions", "native")


def _problem() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(5, 4, generator=g, dtype=torch.float64)
    return q, k, v, table


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_query_row_poisons_that_row_only(implementation, bad):
    q, k, v, table = _problem()
    kwargs = dict(max_distance=2, rel_keys=table, rel_values=table, implementation=implementation)
    clean = relative_attention(q, k, v, **kwargs)
    q = q.clone()
    q[1, 0, 3, 2] = bad
    out = relative_attention(q, k, v, **kwargs)
    poisoned = ~out.isfinite().all(-1)
    assert poisoned.nonzero().tolist() == [[1, 0, 3]]
    torch.testing.assert_close(out[~poisoned], clean[~poisoned], rtol=0, atol=0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_non_finite_key_poisons_the_rows_that_see_it(implementation):
    q, k, v, table = _problem()
    k = k.clone()
    k[0, 1, 4, 0] = float("nan")
    out = relative_attention(q, k, v, max_distance=2, rel_keys=table, is_causal=True,
                             implementation=implementation)
    poisoned = ~out.isfinite().all(-1)
    sees = torch.zeros_like(poisoned)
    sees[0, 1, 4:] = True  # causal: rows 4.. see key 4
    assert (poisoned >= sees).all()
    # documented: these keep the rows that cannot see it finite
    if implementation != "flash_regions":
        assert torch.equal(poisoned, sees)


@pytest.mark.parametrize("implementation", ["reference", "bucketed"])
def test_minus_inf_in_float_mask_means_masked(implementation):
    q, k, v, table = _problem()
    float_mask = torch.zeros(9, 9, dtype=torch.float64)
    float_mask[:, 4] = float("-inf")
    float_mask[6, :] = float("-inf")  # a row that sees nothing
    kwargs = dict(max_distance=2, rel_keys=table, rel_values=table, implementation=implementation)
    out = relative_attention(q, k, v, attn_mask=float_mask, **kwargs)
    want = relative_attention(q, k, v, attn_mask=float_mask == 0, **kwargs)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-15)
    assert (out[:, :, 6] == 0).all()
    plus_inf = torch.zeros(9, 9, dtype=torch.float64)
    plus_inf[2, 3] = float("inf")  # +inf is not a mask: row 2 becomes NaN
    out = relative_attention(q, k, v, attn_mask=plus_inf, **kwargs)
    assert (~out.isfinite().all(-1)).nonzero()[:, 2].unique().tolist() == [2]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_rows_that_see_no_key_are_zero_with_zero_gradient(implementation):
    q, k, v, table = _problem()
    q.requires_grad_(True)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[1] = False
    out = relative_attention(q, k, v, max_distance=2, rel_keys=table, rel_values=table,
                             key_mask=key_mask, implementation=implementation)
    assert (out[1] == 0).all() and out.isfinite().all()
    out.sum().backward()
    assert q.grad is not None and (q.grad[1] == 0).all() and q.grad.isfinite().all()
