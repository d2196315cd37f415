"""Token-by-token decoding of a :class:`relpos.models.RelativeTransformerLM` with few ops a step.

Shape legend: B batch, H heads, D head dim, E ``d_model``, S cached positions after the step,
C cache capacity, R table rows (``left + right + 1``), V vocabulary.

A decode step is one new token per sequence. Through the modules it costs about 115 ATen
calls per layer (counted at the dispatcher: argument checks, mask normalization, backend
selection, separate q/k/v views, a general attention backend): at batch 1 that overhead,
not the arithmetic, is what separates the step from reading the weights once.
:class:`StepDecoder` runs the same math with about 40 ATen calls per layer, 15 of them
computing (the rest are views):

* one fused QKV projection (the module's stacked ``in_proj_weight``), its output viewed as
  ``(B, 3, H, D)`` without a copy;
* keys and values written in place into a static, preallocated :class:`relpos.KVCache`
  (the same cache the prefill filled);
* the relative terms of a single query need no index tensor at all. The query sits at the
  last position ``p = S - 1`` and sees offsets ``j - p`` in ``[-(S-1), 0]``: the last
  ``m = min(S, left + 1)`` keys take table rows ``left + 1 - m .. left`` one each (a slice
  of ``q @ rel_keys.T``), every earlier key takes row 0 (offset clipped to ``-left``), so
  the bias is two in-place adds of slices, and the value term is the band's weights times
  ``m`` table rows plus the far keys' total weight times row 0.

The result equals the modules' (the tests compare both against the reference in float64).
The step is this module's Python alone (a C++ copy of its calls measured 2-6% faster a token,
benchmarks/ct2_decode_epyc.md, and was dropped for one home of the math). Where the native
kernels are built, in float32 they give the step its attention (``decode_attention``: each
head's cached keys and values streamed once, 2x faster than SDPA's kernel for one query on an
AMD EPYC) and, at batch > 1 on CPUs other
than Intel's, its linears (``panel_linear``, :func:`decode_packing`).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos import _env
from relpos._sysinfo import cpuinfo
from relpos.cache import KVCache

__all__ = ["StepDecoder", "decode_linear", "decode_packing", "sinusoidal_positions"]


def sinusoidal_positions(
    start: int, length: int, dim: int, *, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Vaswani et al.'s positions ``start .. start+length-1`` as ``(length, dim)``."""
    pos = torch.arange(start, start + length, device=device, dtype=torch.float64)  # (L,)
    return _sinusoidal(pos, dim, dtype)


def _sinusoidal(pos: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """The sinusoidal embeddings ``(L, dim)`` of float64 positions ``(L,)`` (the same bits
    for a position wherever it sits in ``pos``)."""
    device = pos.device
    half = (dim + 1) // 2
    freq = torch.exp(
        -math.log(10000.0) * torch.arange(half, device=device, dtype=torch.float64) * 2 / dim
    )  # (half,)
    angles = pos[:, None] * freq[None, :]  # (L, half)
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)[:, :dim]  # (L, dim)
    return pe.to(dtype)



Linear = Callable[[Tensor], Tensor]

# id(weight) -> (a weak reference to it, (version, data pointer, batch size, layout kind),
# its decode layout): one copy per weight, dropped with the weight; a stale entry (the weight
# changed in place, another batch size or layout) is rebuilt. Keyed by identity: tensors
# compare by value.
_LAYOUTS: dict[int, tuple[weakref.ref[Tensor], tuple[int, int, int, int], Tensor]] = {}


#: How a float32 decode linear's weight is packed at batch > 1 (decode_packing).
PACKING_ENV = "RELPOS_DECODE_PACKING"
PACKINGS = ("relpos", "onednn", "mkl", "none")


def _mkl_packing() -> bool:
    return bool(
        torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def _onednn_packing() -> bool:
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _native_decode_ops(*, vectorized: bool = False) -> Any:
    """The native kernels' module where it has the panel linears and the decode attention,
    else None; ``vectorized``: only where they run on the kernels' float32 vectors
    (:func:`_vectorized`)."""
    from relpos.ops.native.build import load

    module = load()
    ops = ("panel_linear", "pack_panels", "decode_attention")
    if module is None or not all(hasattr(module, o) for o in ops):
        return None
    return module if not vectorized or _vectorized(module) else None


def _vectorized(module: Any) -> bool:
    """Whether the loaded kernels were built with their float32 vector code (AVX-512 or AVX2,
    ``vectors=`` in ``build_info()``). Without it (the ``baseline`` x86-64 variant, CPUs of
    other architectures) the decode kernels are plain loops: on an AMD EPYC the baseline
    variant's decode attention took 5-10x SDPA's time, its panels 1.2-1.7x MKL's at one row
    and 7-9x oneDNN's at eight, so by default the step does not use them there."""
    from relpos.ops.native.build import has_vectors

    return has_vectors(module)


def decode_packing() -> str:
    """How float32 decode weights are packed: ``"relpos"`` (the native kernels' panels,
    ``panel_linear``: each 16 outputs' weights one contiguous stream; every batch size,
    batch 1 included), ``"mkl"`` (``torch.ops.mkl._mkl_linear``), ``"onednn"``
    (``torch.ops.mkldnn._linear_pointwise``) or ``"none"`` (the transposed weight); the last
    three for batches of more than one row (at batch 1 they read the weight with its longer
    side contiguous, :func:`decode_linear`).

    ``RELPOS_DECODE_PACKING=relpos|onednn|mkl|none`` asks for one (one not there gives
    ``"none"``); by default MKL on Intel CPUs (measured there: 1.7x faster than
    ``F.linear`` at batch 8), the panels on others where the native kernels are built with
    their vector code (AVX-512 or AVX2: :func:`_vectorized`), else oneDNN, else MKL. On an
    AMD EPYC (Zen 4), 8 rows against 512-2048 x 512 weights, MKL's packed GEMM ran at
    ``F.linear``'s speed, oneDNN's 1.4-1.8x faster and the panels another 1.35-1.7x (16-23
    GB/s of weights; ``benchmarks/ct2_decode_epyc.md``); at batch 1 the panels read 512-2048 x
    512 weights at 22-26 GB/s there, 1.2-2.2x the rate of MKL's matrix-vector product in the
    better of its two layouts; the AVX2 build's panels took 0.97-1.09x the AVX-512 build's
    time at one row, 1.15-1.25x at eight (0.76-0.94x oneDNN's). The panels are not measured
    on an Intel CPU. A value that is none of those is ignored with one warning (the default
    serves; :mod:`relpos._env` reads every switch so).
    """
    want = _env.choice(PACKING_ENV, PACKINGS, fallback="the default packing for this CPU "
                       "serves")
    have = {"relpos": lambda: _native_decode_ops() is not None, "onednn": _onednn_packing,
            "mkl": _mkl_packing, "none": lambda: True}
    if want:
        return want if have[want]() else "none"
    have["relpos"] = lambda: _native_decode_ops(vectorized=True) is not None
    intel = cpuinfo().get("vendor_id") == "GenuineIntel"
    order = ("mkl", "onednn") if intel else ("relpos", "onednn", "mkl")
    return next((name for name in order if have[name]()), "none")


def _layout(weight: Tensor, batch: int, kind: int, make: Callable[[Tensor], Tensor]) -> Tensor:
    key = (weight._version, weight.data_ptr(), batch, kind)
    hit = _LAYOUTS.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == key:
        return hit[2]
    laid = make(weight.detach())
    ident = id(weight)
    ref = weakref.ref(weight, lambda _: _LAYOUTS.pop(ident, None))
    _LAYOUTS[ident] = (ref, key, laid)
    return laid


def decode_linear(weight: Tensor, bias: Tensor | None, batch: int, *, fast: bool = True) -> Linear:
    """``x -> F.linear(x, weight, bias)`` for ``(batch, in)`` inputs, in the weight layout
    that reads fastest at that batch size on a CPU (float32):

    * where :func:`decode_packing` is ``"relpos"`` (by default on CPUs other than Intel's,
      where the native kernels are built with their vector code), at every batch size: the
      native kernels' panels, each 16 outputs' weights one contiguous stream; at batch 8
      2.0-3.0x faster than ``F.linear`` on an AMD EPYC, at batch 1 1.2-2.2x faster than
      MKL's matrix-vector product in the better of the two layouts below;
    * else at ``batch > 1``: the weight packed once as :func:`decode_packing` says (oneDNN's
      ``torch.ops.mkldnn._linear_pointwise`` or MKL's ``torch.ops.mkl._mkl_linear``, what
      ``torch.compile`` uses for frozen CPU linears); at batch 8 MKL's is 1.7x faster than
      ``F.linear`` (which repacks the weight on every call) on an Intel Xeon;
    * else at ``batch == 1``: the weight stored with its longer side contiguous, so that the
      matrix-vector product streams long rows: transposed once (``x @ W.T``) where it has
      more outputs than inputs, as it is (``F.linear``) otherwise (on an AMD EPYC the rows
      of 2048 read 1.5-1.9x faster than rows of 512, either way round).

    The layouts are cached per weight (one extra copy of it) and rebuilt when the weight
    changes in place; other dtypes and devices, and ``fast=False``, use ``F.linear``. The
    results equal ``F.linear``'s up to float32 rounding (another summation order).
    """
    kind, laid = _linear_layout(weight, batch, fast)
    if laid is None:
        return lambda x: F.linear(x, weight, bias)
    if kind == _MKL_PACKED:
        return lambda x: torch.ops.mkl._mkl_linear(x, laid, weight, bias, batch)
    if kind == _ONEDNN_PACKED:
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, laid, bias, "none", [], "")
    if kind == _PANELS:
        panel_linear, n = _native_decode_ops().panel_linear, weight.shape[0]
        return lambda x: panel_linear(x, laid, bias, n)
    if bias is None:
        return lambda x: torch.mm(x, laid)
    return lambda x: torch.addmm(bias, x, laid)


# How a decode linear reads its weight.
_PLAIN, _TRANSPOSED, _MKL_PACKED, _ONEDNN_PACKED, _PANELS = 0, 1, 2, 3, 4


def _linear_layout(weight: Tensor, batch: int, fast: bool) -> tuple[int, Tensor | None]:
    """decode_linear's choice for ``weight`` at ``batch``: (kind, the weight's layout)."""
    if not fast or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return _PLAIN, None
    packing = decode_packing()
    if packing == "relpos":  # the same panels for every batch size, batch 1 included
        return _PANELS, _layout(
            weight, 0, _PANELS, lambda w: _native_decode_ops().pack_panels(w.contiguous())
        )
    if batch > 1:
        if packing == "onednn":
            return _ONEDNN_PACKED, _layout(
                weight, batch, _ONEDNN_PACKED,
                lambda w: torch.ops.mkldnn._reorder_linear_weight(w, batch),
            )
        if packing == "mkl":
            return _MKL_PACKED, _layout(
                weight, batch, _MKL_PACKED,
                lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, batch),
            )
    elif weight.shape[1] > weight.shape[0]:  # more inputs than outputs: rows as they are
        return _PLAIN, None
    return _TRANSPOSED, _layout(weight, 1, _TRANSPOSED, lambda w: w.t().contiguous())  # (in, out)


def _grown(x: Tensor, length: int, capacity: int) -> Tensor:
    """``(B, H, C, X)`` storage copied into ``capacity`` positions (its first ``length``)."""
    y = x.new_empty(*x.shape[:2], capacity, x.shape[3])
    y[:, :, :length] = x[:, :, :length]
    return y


@dataclass(frozen=True)
class _Layer:
    """One block's parameters, in the order the step uses them."""

    norm1: tuple[Tensor, Tensor | None, float]
    qkv_weight: Tensor  # (3E, E): [Wq; Wk; Wv]
    qkv_bias: Tensor | None
    rel_keys: Tensor | None  # (R, D) shared or (H, R, D) per head
    rel_values: Tensor | None
    out_weight: Tensor
    out_bias: Tensor | None
    norm2: tuple[Tensor, Tensor | None, float]
    ff1_weight: Tensor
    ff1_bias: Tensor | None
    ff2_weight: Tensor
    ff2_bias: Tensor | None


class StepDecoder:
    """Decode steps of one :class:`RelativeTransformerLM` over a static cache.

    Reads the model's parameters (no copies; build a new decoder after changing them).
    The model must be in eval mode; dropout is not applied.

    Args:
        model: a :class:`relpos.models.RelativeTransformerLM`.
        fast_linears: run the linears in :func:`decode_linear`'s layouts (default) or as
            ``F.linear``.
        native: deprecated, without effect (the layers' calls once ran in C++ where it asked;
            they run in Python, with the native kernels' decode attention and panel linears
            where those are built); anything but None warns.

    Example:
        >>> from relpos.models import ModelConfig, RelativeTransformerLM
        >>> model = RelativeTransformerLM(ModelConfig(vocab_size=30, max_distance=4)).eval()
        >>> cache = model.new_cache(capacity=8, growable=False)
        >>> prompt = torch.randint(0, 30, (2, 5))
        >>> _ = model(prompt, cache=cache)
        >>> step = StepDecoder(model)
        >>> logits = step(torch.zeros(2, dtype=torch.long), cache)
        >>> torch.allclose(logits, model(torch.cat([prompt, torch.zeros(2, 1).long()], 1))[:, -1],
        ...                atol=1e-5)
        True
    """

    def __init__(
        self, model: torch.nn.Module, *, fast_linears: bool = True, native: bool | None = None
    ) -> None:
        if native not in (None, True, False):
            raise TypeError(f"native must be None, True or False, got {native!r}")
        if native is not None:
            warnings.warn(
                "StepDecoder(native=...) has no effect and will be removed: the step's calls run"
                " in Python, with the native kernels' decode attention and panel linears where"
                " they are built", DeprecationWarning, stacklevel=2)
        self.fast_linears = fast_linears
        if type(model).__name__ != "RelativeTransformerLM" or not hasattr(model, "layers"):
            raise TypeError(
                f"StepDecoder needs a relpos RelativeTransformerLM, got {type(model).__name__}"
            )
        lm: Any = model  # a RelativeTransformerLM: its blocks' submodules are known
        if lm.head is not None:
            raise ValueError(
                "StepDecoder needs the tied vocabulary head (ModelConfig.num_classes=None), "
                f"this model has num_classes={lm.config.num_classes}"
            )
        cfg = lm.config
        self.config = cfg
        self.embed = lm.embed.weight  # (V, E)
        self.pos_embed = None if lm.pos_embed is None else lm.pos_embed.weight
        self.sinusoidal = cfg.positions == "sinusoidal"
        self.final_norm = (lm.norm.weight, lm.norm.bias, lm.norm.eps)
        E, H = int(cfg.d_model), int(cfg.num_heads)
        self.E: int = E
        self.H: int = H
        self.D: int = E // H
        self.scale = 1.0 / math.sqrt(self.D)
        self.emb_scale = math.sqrt(E)
        self.layers: list[_Layer] = []
        for layer in lm.layers:
            attn = layer.self_attn
            if attn.in_proj_weight is None:  # always stacked for self-attention models
                raise ValueError("StepDecoder needs a stacked in_proj_weight")
            if layer.activation is not F.gelu:  # what the models build
                raise ValueError("StepDecoder expects the models' GELU blocks")
            self.layers.append(_Layer(
                norm1=(layer.norm1.weight, layer.norm1.bias, layer.norm1.eps),
                qkv_weight=attn.in_proj_weight, qkv_bias=attn.in_proj_bias,
                rel_keys=attn.rel_keys, rel_values=attn.rel_values,
                out_weight=attn.out_proj.weight, out_bias=attn.out_proj.bias,
                norm2=(layer.norm2.weight, layer.norm2.bias, layer.norm2.eps),
                ff1_weight=layer.linear1.weight, ff1_bias=layer.linear1.bias,
                ff2_weight=layer.linear2.weight, ff2_bias=layer.linear2.bias,
            ))
        first = lm.layers[0].self_attn
        self.left = first.window[0]

    @torch.no_grad()
    def start(self, cache: KVCache) -> None:
        """Build the step storages from a cache the prompt was just written into.

        Called after the prefill (the model's forward with ``cache=``), before the first
        step. Every cached key becomes ``k_j + rel_keys[0]`` (the row of every offset
        ``<= -left``) and value ``v_j + rel_values[0]``; a step rewrites only the band.
        A step calls it again by itself when the cache changed since this decoder's last step
        (an append through the model, ``truncate``, ``reorder``, ``reset`` and a new prefill:
        :attr:`relpos.LayerCache.version`), and a growable cache may grow under the steps.
        """
        self._plus: list[tuple[Tensor | None, Tensor | None]] = []
        self._linears: list[tuple[Linear, Linear, Linear, Linear]] = []
        B = cache.batch_size or 1
        fast = self.fast_linears
        # float32 on the CPU: the native kernels' decode attention (one query per head over
        # the cache, each head's keys and values streamed once; 2x faster than SDPA's kernel
        # at batch 8 here) where they are built with their vector code
        cpu32 = self.embed.device.type == "cpu" and self.embed.dtype == torch.float32
        ops = _native_decode_ops(vectorized=True) if cpu32 else None
        self._attend = None if ops is None else ops.decode_attention
        for layer in self.layers:
            self._linears.append((
                decode_linear(layer.qkv_weight, layer.qkv_bias, B, fast=fast),
                decode_linear(layer.out_weight, layer.out_bias, B, fast=fast),
                decode_linear(layer.ff1_weight, layer.ff1_bias, B, fast=fast),
                decode_linear(layer.ff2_weight, layer.ff2_bias, B, fast=fast),
            ))
        self._head = decode_linear(self.embed, None, B, fast=fast)
        for layer, lc in zip(self.layers, cache, strict=True):
            keys, values = lc.keys, lc.values
            if keys is None or values is None:
                raise ValueError("StepDecoder.start needs the prompt in the cache (prefill first)")
            cap = lc.capacity
            pk = pv = None
            if layer.rel_keys is not None:
                pk = keys.new_empty(keys.shape[0], keys.shape[1], cap, keys.shape[3])
                torch.add(keys, layer.rel_keys[..., :1, :], out=pk[:, :, : keys.shape[2]])
            if layer.rel_values is not None:
                pv = values.new_empty(values.shape[0], values.shape[1], cap, values.shape[3])
                torch.add(values, layer.rel_values[..., :1, :], out=pv[:, :, : values.shape[2]])
            self._plus.append((pk, pv))
        self._seen = self._versions(cache)

    @staticmethod
    def _versions(cache: KVCache) -> tuple[int, ...]:
        return tuple(lc.version for lc in cache)  # unique across caches

    @torch.no_grad()
    def __call__(self, token: Tensor, cache: KVCache, positions: Tensor | None = None) -> Tensor:
        """Logits ``(B, V)`` of one new token per sequence, appended to ``cache``.

        Args:
            token: ``(B,)`` token ids (validated by the caller).
            cache: the model's cache, holding the prompt (and earlier steps); fixed-size
                or growable.
            positions: ``(B,)`` integer: each row's absolute position of the new token, for
                rows whose positions are not the cache's (left-padded prompts of different
                lengths, each from position 0: ``RelativeTransformerLM.generate_packed``);
                None = ``cache.length`` for every row. Only models with absolute positions
                (``positions="learned"`` or ``"sinusoidal"``) read it; validated by the caller.
        """
        if getattr(self, "_seen", None) != self._versions(cache):
            self.start(cache)  # a new cache, or one changed since the last step
        B = token.shape[0]
        E, H, D = self.E, self.H, self.D
        p = cache.length  # position of the new token in the cache
        S = p + 1
        x = F.embedding(token, self.embed).mul_(self.emb_scale)  # (B, E)
        if self.pos_embed is not None:
            x = x + (self.pos_embed[p] if positions is None
                     else F.embedding(positions, self.pos_embed))
        elif self.sinusoidal:
            at = (torch.tensor([p], dtype=torch.float64, device=x.device) if positions is None
                  else positions.to(torch.float64))
            x = x + _sinusoidal(at, E, x.dtype)
        left = self.left
        m = min(S, left + 1)  # the band: keys whose table row changes from step to step
        band = slice(S - m, S)
        band_rows = slice(left + 1 - m, left + 1)
        views = []
        for n, lc in enumerate(cache):
            keys, values, key_mask = lc.reserve_step(B, H, D)  # (B, H, S, D) views
            pk, pv = self._plus[n]
            if (pk is not None and pk.shape[2] < S) or (pv is not None and pv.shape[2] < S):
                pk, pv = (None if t is None else _grown(t, S - 1, lc.capacity) for t in (pk, pv))
                self._plus[n] = (pk, pv)  # the cache grew: so do the storages
            views.append((keys, values, key_mask, pk, pv))
        for layer, (keys, values, key_mask, pk, pv), (qkv_proj, out_proj, ff1, ff2) in zip(
            self.layers, views, self._linears, strict=True
        ):
            h = F.layer_norm(x, (E,), *layer.norm1)
            qkv = qkv_proj(h).view(B, 3, H, D)
            keys[:, :, p].copy_(qkv[:, 1])
            values[:, :, p].copy_(qkv[:, 2])
            # k_j + rel_keys[row of j]: the band's rows shift by one each step
            if pk is not None and layer.rel_keys is not None:
                torch.add(keys[:, :, band], layer.rel_keys[..., band_rows, :],
                          out=pk[:, :, band])
                keys = pk[:, :, :S]
            if pv is not None and layer.rel_values is not None:
                torch.add(values[:, :, band], layer.rel_values[..., band_rows, :],
                          out=pv[:, :, band])
                values = pv[:, :, :S]
            # q.(k_j + a_j) and sum_j p_j (v_j + b_j) with one scale: (B, H, D)
            if self._attend is not None:
                out = self._attend(qkv[:, 0], keys, values, key_mask)
            else:
                mask = None if key_mask is None else key_mask[:, None, None, :]
                out = F.scaled_dot_product_attention(
                    qkv[:, 0].unsqueeze(2), keys, values, attn_mask=mask
                )
            x = x + out_proj(out.view(B, E))
            h = F.layer_norm(x, (E,), *layer.norm2)
            h = F.gelu(ff1(h))
            x = x + ff2(h)
        cache.advance(1)
        self._seen = self._versions(cache)
        x = F.layer_norm(x, (E,), *self.final_norm)
        return self._head(x)  # (B, V), tied head
