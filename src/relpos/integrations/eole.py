"""eole models through relpos (extra ``relpos[eole]``).

eole (the successor of OpenNMT-py) builds Shaw's clipped relative positions into its
self-attention when a model is configured with ``position_encoding_type: Relative`` and
``n_positions: K``: one table ``relative_positions_embeddings`` of ``2K + 1`` rows of the head
size per self-attention layer (encoder and decoder; cross-attention has none), shared by the
heads and used as both the key and the value embedding. eole then never uses SDPA or flash
attention: it materializes the ``(L, S, D)`` embedding in every layer and multiplies the
``(L, B·H, S)`` probabilities by it.

:func:`patch` routes every such self-attention (``eole.modules.multi_headed_attn.SelfMHA``)
through :func:`relpos.relative_attention`, in place, in training and in eole's own inference
(its ``Translator`` and ``GeneratorLM``, greedy and beam search, with its KV cache).
Parameters, buffers and the state dict are untouched (only each attention module's ``forward``
is replaced), so eole checkpoints, eole's CTranslate2 converter and everything else keep
working; patch a model again after building or loading it, or call :func:`patch_on_build` once
so that every eole model built afterwards in the process is patched. The patch itself pickles
(``torch.save`` of a patched model loads back patched), though stock eole 0.6.4 models do not
(each attention and MLP holds a lambda, ``maybe_ckpt``).

eole's scores are ``scale · q·k + q·aK``: the relative key term uses the unscaled query
(OpenNMT-py and CTranslate2 scale both terms; eole's CTranslate2 converter multiplies the
table by ``sqrt(D)`` for that reason). relpos scales both, so the patch passes
``rel_keys = aK / scale`` and ``rel_values = aK``: the same scores up to rounding.

**Cached decoding.** eole's KV cache is a buffer larger than the tokens written to it (a
dynamic cache grows by 32 slots at a time; a static one is allocated at its maximum length).
Stock eole 0.6.4 places the query of a cached step at the last slot of that buffer
(``gen_relative_positions(key_len, cache=True)`` with the buffer length) instead of at its own
step, and a prompt prefill through the cache gives every query the last query's offsets; its
cached outputs therefore differ from the model's own full forward for relative-position models.
Patched, a cached step's queries sit at their real positions (``cache_seqlens`` and on), the
keys are the ones written so far, and cached decoding equals the full forward.

Query rows that see no key at all (the padding rows of a left-padded prompt) come out as zeros,
where eole averages every value; no real token attends to those rows.

Example::

    model = EncoderDecoderModel.for_training(model_config, vocabs, running_config)
    relpos.integrations.eole.patch(model)   # -> number of self-attention modules patched

Shape legend: B batch, L queries, S keys, H heads, D head size (``dim_per_head``),
K clip distance (``n_positions``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos.functional import relative_attention, relative_attention_with_weights
from relpos.integrations._patching import PATCHED, is_patched, route

__all__ = ["SUPPORTED", "is_patched", "patch", "patch_on_build"]

SUPPORTED: dict[str, str] = {"SelfMHA": "eole.modules.multi_headed_attn"}
"""Attention classes :func:`patch` serves, by name, with the module that defines them."""



def _self_attention_class() -> type:
    try:
        from eole.modules.multi_headed_attn import SelfMHA
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "relpos.integrations.eole needs the eole package: pip install 'relpos[eole]'"
        ) from err
    return SelfMHA


def _position_kind(module: Any) -> str:
    """How an eole self-attention encodes positions, in eole's config words."""
    if getattr(module, "relative_attention_bias", None) is not None:
        return (f"relative_positions_buckets={module.relative_positions_buckets} "
                "(T5 bucketed biases)")
    kind = getattr(module, "position_encoding_type", None)
    return f"position_encoding_type={getattr(kind, 'value', kind)!r}"


def _refusal(module: Any) -> str | None:
    parallel = getattr(module, "parallel_gpu", 1)
    if parallel != 1:
        return (f"tensor-parallel attention (parallel_gpu={parallel}) is not supported; "
                "allowed: parallel_gpu=1")
    return None


def _cache_start(cache_seqlens: Tensor | None) -> int:
    """The step of this call's first token: the tokens already in the cache (eole keeps one
    count for the whole batch)."""
    if cache_seqlens is None:
        raise RuntimeError("eole passed a KV cache without cache_seqlens")
    low, high = torch.stack(torch.aminmax(cache_seqlens)).tolist()
    if low != high:
        raise ValueError(
            f"cache_seqlens differ across the batch (from {low} to {high}); eole decodes a "
            "batch in lockstep and relpos serves one position for all rows"
        )
    return int(low)


def _masks(attn_mask: Tensor | None, B: int, L: int, S: int) -> tuple[
    Tensor | None, Tensor | None, bool
]:
    """``(key_mask, attn_mask, is_causal)`` for relpos from eole's self-attention mask.

    eole's mask is bool, True = may attend (relpos's functional meaning), ``(B, 1, 1, S)``
    (encoder, decoding steps) or ``(B, 1, L, S)`` (decoder: causal and padding). A padding-only
    mask becomes a ``(B, S)`` key mask and a causal-and-padding one a key mask with
    ``is_causal`` (both O(n) memory in the flash_regions backend); anything else (a prefix LM, a
    sliding window) is passed on as it is.
    """
    if attn_mask is None:
        return None, None, False
    if attn_mask.dtype != torch.bool:
        raise TypeError(
            f"eole's attention mask should be bool (True = attend), got {attn_mask.dtype}"
        )
    mask = attn_mask if attn_mask.dim() == 4 else attn_mask[None, None]
    if mask.shape[1] != 1:
        return None, mask, False
    keys = mask[:, 0, -1, :].expand(B, S)  # the last query sees every key a causal mask allows
    is_causal = False
    if mask.shape[2] != 1:
        rows = mask[:, 0]  # (B or 1, L, S)
        if not bool((rows == keys[:, None, :]).all()):
            # Bottom-right causal: query i sits at position S - L + i.
            causal = torch.ones(L, S, dtype=torch.bool, device=mask.device).tril(S - L)
            if not bool((rows == (causal & keys[:, None, :])).all()):
                return None, mask, False
            is_causal = True
    if bool(keys.all()):
        return None, None, is_causal
    return keys.contiguous(), None, is_causal


def _relpos_forward(
    self: Any,  # an eole SelfMHA with Shaw relative positions
    query: Tensor,
    attn_mask: Tensor | None = None,
    return_attn: bool | None = False,
    position_embeddings: Tensor | None = None,
    cache_seqlens: Tensor | None = None,
    cache_slice: Tensor | None = None,
    pos_ids_2d: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The patched ``SelfMHA.forward``: eole's projections and cache, relpos's attention."""
    key, value, query = self._prepare_inputs(
        query, query, query, position_embeddings=position_embeddings, pos_ids_2d=pos_ids_2d,
    )  # (B, L, Hkv, D), (B, L, Hkv, D), (B, L, H, D)
    B, L = query.shape[:2]
    buffer_len = None
    if self.kcache is not None:
        if cache_slice is None:
            raise RuntimeError(
                "eole chose its flash KV-cache path, which it never does for relative positions"
            )
        start = _cache_start(cache_seqlens)
        key, value, query = self._update_cache_w_inputs(
            query, key, value, cache_seqlens=cache_seqlens, cache_slice=cache_slice,
        )
        buffer_len = key.shape[1]
        # The keys written so far; the buffer beyond them is empty and masked. With S = end,
        # relpos's bottom-right alignment puts query i at its real position start + i.
        key, value = key[:, : start + L], value[:, : start + L]
    S = key.shape[1]
    H = query.shape[2]
    if key.shape[2] != H:  # grouped-query attention: eole repeats the kv heads
        key = key.repeat_interleave(H // key.shape[2], dim=2)
        value = value.repeat_interleave(H // value.shape[2], dim=2)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, L or S, D)
    scale = self.dim_per_head**-0.5 if self.scale is None else self.scale
    table = self.relative_positions_embeddings.weight.to(q.dtype)  # (2K+1, D)
    key_mask, dense_mask, is_causal = _masks(
        None if attn_mask is None else attn_mask[..., :S], B, L, S
    )
    options: dict[str, Any] = dict(
        max_distance=self.n_positions,
        # eole adds q·aK unscaled to scale·q·k; relpos scales both terms.
        rel_keys=table / scale, rel_values=table, key_mask=key_mask, attn_mask=dense_mask,
        is_causal=is_causal, dropout_p=self.dropout_p if self.training else 0.0, scale=scale,
    )
    weights: Tensor | None = None
    if return_attn:
        out, weights = relative_attention_with_weights(q, k, v, **options)
        if buffer_len is not None:
            weights = F.pad(weights, (0, buffer_len - S))  # eole's shape: the whole buffer
    else:
        out = relative_attention(q, k, v, **options)
    context = out.transpose(1, 2).reshape(B, L, -1)  # (B, L, H·D)
    if self.q_gating and hasattr(self, "_attn_gate"):
        context = context * self._attn_gate
    if self.kcache is not None:
        return self.final_linear(context), weights
    return self.maybe_ckpt(self.final_linear, context), weights


def patch(model: nn.Module) -> int:
    """Route every Shaw relative self-attention of an eole model through relpos, in place.

    Args:
        model: an eole model (``EncoderDecoderModel``, ``DecoderModel``, ``EncoderModel``) or
            any ``nn.Module`` containing eole ``SelfMHA`` modules built with
            ``position_encoding_type: Relative`` (``n_positions: K``).

    Returns:
        The number of self-attention modules patched (modules already patched count too).
        Cross-attention and self-attention with other positions (rotary, ALiBi, sinusoidal,
        learned, T5 buckets) are left as they are.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
        ValueError: if the model has no Shaw relative self-attention, or one relpos does not
            serve (tensor parallel); nothing is patched then.
        ModuleNotFoundError: without the ``eole`` package.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch expects an eole model (nn.Module), got {type(model).__name__}")
    found = [m for m in model.modules() if isinstance(m, _self_attention_class())]
    relative = [m for m in found if getattr(m, "relative_positions_embeddings", None) is not None]
    if not relative:
        kinds = sorted({_position_kind(m) for m in found})
        seen = f"its self-attention uses {', '.join(kinds)}" if kinds else "it has no eole SelfMHA"
        raise ValueError(
            f"{type(model).__name__} has no attention relpos can serve: {seen}; allowed: "
            "position_encoding_type='Relative' with n_positions=K"
        )
    return route(model, relative, _refusal, _relpos_forward)


def _has_relative_self_attention(model: nn.Module) -> bool:
    cls = _self_attention_class()
    return any(isinstance(m, cls) and getattr(m, "relative_positions_embeddings", None)
               is not None for m in model.modules())


def _log_patched(model: nn.Module, count: int) -> None:
    """Say in eole's log (its ``"eole"`` logger) that relpos serves ``model``'s attention."""
    patched: list[Any] = [m for m in model.modules() if getattr(m, PATCHED, False)]
    clips = sorted({int(m.n_positions) for m in patched})
    logging.getLogger("eole").info(
        "relpos: patched %d self-attention layers of %s (position_encoding_type=Relative, "
        "n_positions=%s)", count, type(model).__name__, ", ".join(map(str, clips)),
    )


def patch_on_build() -> None:
    """Patch every eole model with Shaw relative positions built from now on in this process.

    Wraps ``eole.models.model.BaseModel.build``, which ``for_training`` and ``for_inference``
    (so ``eole train`` and ``eole predict``) call; models with other positions are built as
    before. Calling it again does nothing. Each model patched says so in eole's log (the
    ``"eole"`` logger, at INFO): ``relpos: patched 12 self-attention layers of
    EncoderDecoderModel (position_encoding_type=Relative, n_positions=20)``.

    Raises:
        ModuleNotFoundError: without the ``eole`` package.
    """
    _self_attention_class()
    from eole.models.model import BaseModel

    build = BaseModel.__dict__["build"].__func__
    if getattr(build, PATCHED, False):
        return

    @functools.wraps(build)
    def build_and_patch(cls: type, *args: Any, **kwargs: Any) -> nn.Module:
        model = build(cls, *args, **kwargs)
        if _has_relative_self_attention(model):
            _log_patched(model, patch(model))
        return model

    setattr(build_and_patch, PATCHED, True)
    BaseModel.build = classmethod(build_and_patch)
