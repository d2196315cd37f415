"""Drop-in replacements for ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``.

Same constructor arguments and defaults (``batch_first=False``), forward signatures, mask
meanings (bool ``*_mask`` True = NOT allowed, ``*_key_padding_mask`` True = padding, float
masks added) and submodule names as PyTorch's layers, so they work inside
``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` and a PyTorch layer's state dict loads
into them with only the relative tables missing. Self-attention uses clipped relative
positions (``max_distance``: a clip distance ``K`` or a window ``(left, right)``, required,
keyword-only); cross-attention is plain unless
``relative_cross_attention``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos.cache import LayerCache, PackedLayerCache
from relpos.functional import Implementation
from relpos.modules._checks import (
    REQUIRED,
    check_bool,
    check_dropout,
    check_input_tensor,
    check_module_max_distance,
    check_positive_float,
    check_positive_int,
    nn_masks_to_relpos,
)
from relpos.modules.attention import RelativeMultiheadAttention

__all__ = ["RelativeTransformerDecoderLayer", "RelativeTransformerEncoderLayer"]

Activation = str | Callable[[Tensor], Tensor]


def _activation(activation: Activation) -> Callable[[Tensor], Tensor]:
    if callable(activation):
        return activation
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    raise ValueError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")


def _activation_name(fn: Callable[[Tensor], Tensor]) -> str:
    """The constructor argument that rebuilds the activation ``fn``."""
    if fn is F.relu:
        return "relu"
    if fn is F.gelu:
        return "gelu"
    raise ValueError(
        f"a layer with a custom activation {fn!r} has no config to rebuild it from; "
        f"allowed: 'relu' or 'gelu'"
    )


def _layer_dims(x: object, like: Tensor, batch_first: bool, name: str) -> tuple[bool, int, int]:
    """(batched, B, L) of a layer input, after checking it is a 2-D or 3-D floating-point
    tensor with the dtype and device of the layer's parameters ``like``."""
    layout = "(B, L, E)" if batch_first else "(L, B, E)"
    t = check_input_tensor(name, x, like=like, ndims=(2, 3),
                           layout=f"3-D {layout} or 2-D (L, E) unbatched")
    if t.dim() == 2:
        return False, 1, t.shape[0]
    return True, t.shape[0 if batch_first else 1], t.shape[1 if batch_first else 0]


class _LayerBase(nn.Module):
    """What both layers are made of, in PyTorch's order and under PyTorch's names.

    ``self_attn`` (relative), ``multihead_attn`` (cross-attention, decoder only), the MLP
    ``linear1 -> activation -> dropout -> linear2``, and one ``norm<i>``/``dropout<i>`` per
    sublayer (2 in the encoder, 3 in the decoder). Arguments as in the layers;
    ``relative_cross_attention`` None = no cross-attention (the encoder).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int,
        dropout: float,
        activation: Activation,
        layer_norm_eps: float,
        batch_first: bool,
        norm_first: bool,
        bias: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        *,
        max_distance: int | tuple[int, int],
        relative_keys: bool,
        relative_values: bool,
        share_heads: bool,
        implementation: Implementation | None,
        relative_cross_attention: bool | None = None,
    ) -> None:
        super().__init__()
        d_model = check_positive_int("d_model", d_model)
        nhead = check_positive_int("nhead", nhead)
        dim_feedforward = check_positive_int("dim_feedforward", dim_feedforward)
        dropout = check_dropout(dropout)
        layer_norm_eps = check_positive_float("layer_norm_eps", layer_norm_eps)
        norm_first = check_bool("norm_first", norm_first)
        # K / the window is checked here so that a missing one names the layer, not its
        # attention.
        check_module_max_distance(type(self).__name__, max_distance, dropout=None,
                                  table_columns=None)
        self.activation = _activation(activation)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        attention: dict[str, Any] = dict(
            dropout=dropout, bias=bias, batch_first=batch_first, max_distance=max_distance,
            share_heads=share_heads, implementation=implementation, **factory,
        )
        self.self_attn = RelativeMultiheadAttention(
            d_model, nhead, relative_keys=relative_keys, relative_values=relative_values,
            **attention,
        )
        decoder = relative_cross_attention is not None
        if decoder:
            cross = check_bool("relative_cross_attention", relative_cross_attention)
            self.multihead_attn = RelativeMultiheadAttention(
                d_model, nhead, relative_keys=relative_keys and cross,
                relative_values=relative_values and cross, **attention,
            )
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        if decoder:
            self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        if decoder:
            self.dropout3 = nn.Dropout(dropout)
        # As nn.TransformerEncoderLayer stashes it (1 = relu, 2 = gelu, 0 = other).
        self.activation_relu_or_gelu = (
            1 if self.activation is F.relu else 2 if self.activation is F.gelu else 0
        )

    def get_config(self) -> dict[str, Any]:
        """The constructor's keyword arguments that rebuild this layer (``device``/``dtype``
        aside): ``type(layer)(**layer.get_config())`` is a freshly initialized twin.

        Raises:
            ValueError: if the layer has a custom activation (only ``"relu"`` and ``"gelu"``
                can be named).
        """
        attn = self.self_attn
        return {
            "d_model": attn.embed_dim, "nhead": attn.num_heads,
            "dim_feedforward": self.linear1.out_features, "dropout": self.dropout.p,
            "activation": _activation_name(self.activation), "layer_norm_eps": self.norm1.eps,
            "batch_first": attn.batch_first, "norm_first": self.norm_first,
            "bias": self.linear1.bias is not None, "max_distance": attn.max_distance,
            "relative_keys": attn.relative_keys, "relative_values": attn.relative_values,
            "share_heads": attn.share_heads, "implementation": attn.implementation,
        }

    def _check_masks(
        self,
        x: object,
        x_name: str,
        names: tuple[str, str],
        mask: object,
        padding: object,
        key_mask: object,
        *,
        memory: object = None,
        cache: object = None,
    ) -> None:
        """Check an attention's masks against the layer input under the layer's argument
        names (the attention converts them again)."""
        attn = self.self_attn
        like = attn.out_proj.weight
        batched, B, L = _layer_dims(x, like, attn.batch_first, x_name)
        S, pad_len, cached = L, L, False
        if memory is not None:
            mem_batched, mem_B, S = _layer_dims(memory, like, attn.batch_first, "memory")
            if (mem_batched, mem_B) != (batched, B):
                return  # the attention says how they disagree
            pad_len = S
        elif isinstance(cache, LayerCache):
            S, cached = cache.length + L, True
        nn_masks_to_relpos(
            mask, padding, key_mask, batch=B, heads=attn.num_heads, query_len=L, key_len=S,
            batched=batched, pad_len=pad_len, cached=cached, names=names,
        )

    def _sa_block(
        self,
        x: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        key_mask: Tensor | None,
        cache: LayerCache | PackedLayerCache | None,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        if cu_seqlens is not None:
            out, _ = self.self_attn(
                x, key_padding_mask=key_padding_mask, need_weights=False, attn_mask=attn_mask,
                is_causal=is_causal, key_mask=key_mask, cache=cache, cu_seqlens=cu_seqlens)
            return self.dropout1(out)
        out, _ = self.self_attn(
            x, x, x, key_padding_mask=key_padding_mask, need_weights=False,
            attn_mask=attn_mask, is_causal=is_causal, key_mask=key_mask, cache=cache,
        )
        return self.dropout1(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class RelativeTransformerEncoderLayer(_LayerBase):
    """``nn.TransformerEncoderLayer`` with relative self-attention.

    ``d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
    norm_first, bias, device, dtype`` are as in ``nn.TransformerEncoderLayer``, defaults
    included (inputs are ``(L, B, E)`` unless ``batch_first``); so are the submodule and
    parameter names: ``nn.TransformerEncoderLayer(...).state_dict()`` loads with
    ``strict=False`` and only ``self_attn.rel_keys``/``self_attn.rel_values`` missing.

    Args:
        max_distance: K, the clip distance, or a window ``(left, right)`` (offsets clipped to
            ``[-left, +right]``); required, keyword-only.
        relative_keys, relative_values, share_heads: see :class:`RelativeMultiheadAttention`.
        implementation: backend (None = auto).

    Example:
        >>> layer = RelativeTransformerEncoderLayer(32, 4, 64, batch_first=True, max_distance=8)
        >>> nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)(
        ...     torch.randn(3, 11, 32)).shape
        torch.Size([3, 11, 32])
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        max_distance: int | tuple[int, int] = REQUIRED,
        relative_keys: bool = True,
        relative_values: bool = True,
        share_heads: bool = True,
        implementation: Implementation | None = None,
    ) -> None:
        super().__init__(
            d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
            norm_first, bias, device, dtype, max_distance=max_distance,
            relative_keys=relative_keys, relative_values=relative_values,
            share_heads=share_heads, implementation=implementation,
        )

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        key_mask: Tensor | None = None,
        cache: LayerCache | PackedLayerCache | None = None,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """As ``nn.TransformerEncoderLayer.forward``.

        Args:
            src: ``(L, B, E)``, ``(B, L, E)`` if ``batch_first``, or ``(L, E)`` unbatched.
            src_mask: torch.nn's meaning: bool True = NOT allowed, or float (added);
                ``(L, S)`` or ``(B * H, L, S)``.
            src_key_padding_mask: ``(B, S)``, torch.nn's meaning: bool True = padding, or
                float (added).
            is_causal: without ``src_mask``, key ``j`` is visible to query ``i`` iff
                ``j <= p_i`` (relpos builds the mask); with ``src_mask``, torch.nn's hint that
                the mask is causal (the mask is used as given).
            key_mask: ``(B, S)`` bool in relpos's meaning (True = real token), instead of
                ``src_key_padding_mask``.
            cache: a :class:`relpos.LayerCache`: ``src`` holds the ``t`` new tokens of an
                incremental step; their keys/values are appended and they attend over the
                whole cache (queries aligned to its end). The padding/key mask is then a
                ``(B, t)`` bool mask of the new tokens and ``src_mask`` is ``(t, S)`` or
                ``(B * H, t, S)``.
            cu_seqlens: a packed batch: ``src`` is ``(T, E)``, the sequences end to end, and
                ``cu_seqlens`` ``(N + 1,)`` their boundaries (:func:`relpos.pack`); no masks
                then, and ``cache`` is a :class:`relpos.PackedLayerCache` (see
                :meth:`RelativeMultiheadAttention.forward`).

        Returns:
            Like ``src``.
        """
        check_bool("is_causal", is_causal)
        if cu_seqlens is None:
            self._check_masks(src, "src", ("src_mask", "src_key_padding_mask"), src_mask,
                              src_key_padding_mask, key_mask, cache=cache)
        x = src
        masks = (src_mask, src_key_padding_mask, is_causal, key_mask, cache, cu_seqlens)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), *masks)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, *masks))
            x = self.norm2(x + self._ff_block(x))
        return x


class RelativeTransformerDecoderLayer(_LayerBase):
    """``nn.TransformerDecoderLayer`` with relative self-attention.

    ``d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
    norm_first, bias, device, dtype`` are as in ``nn.TransformerDecoderLayer``, defaults and
    submodule names included.

    Args:
        max_distance: K, the clip distance, or a window ``(left, right)`` (offsets clipped to
            ``[-left, +right]``); required, keyword-only.
        relative_keys, relative_values, share_heads: see :class:`RelativeMultiheadAttention`.
        relative_cross_attention: also use relative positions in cross-attention (queries
            aligned to the end of the memory); default plain cross-attention.
        implementation: backend (None = auto).
    """

    multihead_attn: RelativeMultiheadAttention
    norm3: nn.LayerNorm
    dropout3: nn.Dropout

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        max_distance: int | tuple[int, int] = REQUIRED,
        relative_keys: bool = True,
        relative_values: bool = True,
        share_heads: bool = True,
        relative_cross_attention: bool = False,
        implementation: Implementation | None = None,
    ) -> None:
        super().__init__(
            d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
            norm_first, bias, device, dtype, max_distance=max_distance,
            relative_keys=relative_keys, relative_values=relative_values,
            share_heads=share_heads, implementation=implementation,
            relative_cross_attention=relative_cross_attention,
        )

    def get_config(self) -> dict[str, Any]:
        """The constructor's keyword arguments that rebuild this layer (``device``/``dtype``
        aside), ``relative_cross_attention`` included; see
        :meth:`RelativeTransformerEncoderLayer.get_config`."""
        cross = self.multihead_attn
        return {
            **super().get_config(),
            "relative_cross_attention": cross.relative_keys or cross.relative_values,
        }

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
        *,
        key_mask: Tensor | None = None,
        memory_key_mask: Tensor | None = None,
        cache: LayerCache | None = None,
        cu_seqlens: Tensor | None = None,
        memory_cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """As ``nn.TransformerDecoderLayer.forward``.

        Args:
            tgt: ``(L, B, E)``, ``(B, L, E)`` if ``batch_first``, or ``(L, E)`` unbatched.
            memory: ``(S, B, E)``, ``(B, S, E)`` if ``batch_first``, or ``(S, E)``.
            tgt_mask, memory_mask: torch.nn's meaning: bool True = NOT allowed, or float
                (added); ``(L, L)``/``(L, S)`` or with a leading ``B * H``.
            tgt_key_padding_mask, memory_key_padding_mask: ``(B, L)``/``(B, S)``, torch.nn's
                meaning: bool True = padding, or float (added).
            tgt_is_causal, memory_is_causal: without the matching mask, a causal mask in that
                attention (bottom-right aligned); with it, torch.nn's hint (the mask decides).
            key_mask, memory_key_mask: ``(B, L)``/``(B, S)`` bool in relpos's meaning (True =
                real token), instead of the matching ``*_key_padding_mask``.
            cache: a :class:`relpos.LayerCache` for the self-attention: ``tgt`` holds the
                ``t`` new tokens of an incremental step (see
                :meth:`RelativeTransformerEncoderLayer.forward`); cross-attention still
                attends to the whole ``memory``.
            cu_seqlens, memory_cu_seqlens: a packed batch: ``tgt`` ``(T, E)`` and ``memory``
                ``(Tm, E)``, the sequences end to end, with their boundaries (``(N + 1,)``
                each, N sequences in both; :func:`relpos.pack`). Both or neither; no masks or
                cache then.

        Returns:
            Like ``tgt``.
        """
        check_bool("tgt_is_causal", tgt_is_causal)
        check_bool("memory_is_causal", memory_is_causal)
        if (cu_seqlens is None) != (memory_cu_seqlens is None):
            raise ValueError("a packed decoder call needs both cu_seqlens (tgt) and "
                             "memory_cu_seqlens (memory), got only "
                             + ("cu_seqlens" if cu_seqlens is not None else "memory_cu_seqlens"))
        if cu_seqlens is None:
            self._check_masks(tgt, "tgt", ("tgt_mask", "tgt_key_padding_mask"), tgt_mask,
                              tgt_key_padding_mask, key_mask, cache=cache)
            self._check_masks(tgt, "tgt", ("memory_mask", "memory_key_padding_mask"),
                              memory_mask, memory_key_padding_mask, memory_key_mask,
                              memory=memory)
        self_masks = (tgt_mask, tgt_key_padding_mask, tgt_is_causal, key_mask, cache, cu_seqlens)
        cross = (memory_mask, memory_key_padding_mask, memory_is_causal, memory_key_mask,
                 cu_seqlens, memory_cu_seqlens)
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), *self_masks)
            x = x + self._mha_block(self.norm2(x), memory, *cross)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, *self_masks))
            x = self.norm2(x + self._mha_block(x, memory, *cross))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _mha_block(
        self,
        x: Tensor,
        mem: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        key_mask: Tensor | None,
        cu_seqlens: Tensor | None = None,
        memory_cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        out, _ = self.multihead_attn(
            x, mem, mem, key_padding_mask=key_padding_mask, need_weights=False,
            attn_mask=attn_mask, is_causal=is_causal, key_mask=key_mask,
            cu_seqlens=cu_seqlens, cu_seqlens_k=memory_cu_seqlens,
        )
        return self.dropout2(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout3(x)
