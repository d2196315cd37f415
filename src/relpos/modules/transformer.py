"""Drop-in replacements for ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``.

Same constructor arguments, forward signatures and mask meanings as PyTorch's layers (so they
work inside ``nn.TransformerEncoder`` / ``nn.TransformerDecoder``): boolean ``*_mask`` True =
NOT allowed and ``*_key_padding_mask`` True = padding, as in PyTorch. Self-attention uses
clipped relative positions; cross-attention is plain unless ``relative_cross_attention``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos.cache import LayerCache
from relpos.functional import Implementation
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


def _batch_size(x: object, batch_first: bool) -> int:
    """B of a layer input, after checking it is a 3-D tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"layer inputs must be torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        layout = "(B, L, E)" if batch_first else "(L, B, E)"
        raise ValueError(f"layer inputs must be 3-D {layout}, got shape {tuple(x.shape)}")
    return x.shape[0] if batch_first else x.shape[1]


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


def _relpos_masks(
    mask: Tensor | None,
    padding_mask: Tensor | None,
    key_mask: Tensor | None,
    batch: int,
    heads: int,
) -> tuple[Tensor | None, Tensor | None]:
    """PyTorch's mask meanings -> relpos's: (attn_mask True = may attend, key_mask True = real).

    Args:
        mask: PyTorch's attention mask: bool (True = NOT allowed) or float (added),
            ``(L, S)`` or ``(B * H, L, S)``.
        padding_mask: PyTorch's key padding mask ``(B, S)``: bool (True = padding) or float
            (added to the scores).
        key_mask: relpos's ``(B, S)`` bool key mask (True = real token), passed through as is;
            not together with ``padding_mask``.
        batch, heads: B and H, to unfold a 3-D ``mask``.

    Returns:
        ``(attn_mask, key_mask)`` in the meanings of :func:`relpos.relative_attention`.
    """
    for name, m in (
        ("attention mask", mask), ("key padding mask", padding_mask), ("key_mask", key_mask)
    ):
        if m is not None and not isinstance(m, Tensor):
            raise TypeError(f"the {name} must be a torch.Tensor or None, got {type(m).__name__}")
    if padding_mask is not None and key_mask is not None:
        raise ValueError(
            "got both a key padding mask (PyTorch's meaning, True = padding) and key_mask "
            "(relpos's, True = real token); allowed: one of them"
        )
    if padding_mask is not None and padding_mask.dim() != 2:
        raise ValueError(
            f"the key padding mask must have shape (B, S), got {tuple(padding_mask.shape)}"
        )
    attn_mask = None
    if mask is not None:
        if mask.dim() == 3:  # (B * H, L, S), as nn.MultiheadAttention accepts
            if mask.shape[0] != batch * heads:
                raise ValueError(
                    f"a 3-D attention mask must have shape (B * H, L, S) with B * H = "
                    f"{batch} * {heads} = {batch * heads}, got {tuple(mask.shape)}"
                )
            mask = mask.view(batch, heads, *mask.shape[-2:])  # (B, H, L, S)
        attn_mask = ~mask if mask.dtype == torch.bool else mask
    if padding_mask is not None:
        if padding_mask.dtype == torch.bool:
            key_mask = ~padding_mask
        else:  # a float padding mask is added to the scores
            pad = padding_mask[:, None, None, :]  # (B, 1, 1, S)
            if attn_mask is None:
                attn_mask = pad
            elif attn_mask.dtype == torch.bool:
                attn_mask = pad.masked_fill(~attn_mask, float("-inf"))
            else:
                attn_mask = attn_mask + pad
    return attn_mask, key_mask


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
        max_distance: int,
        relative_keys: bool,
        relative_values: bool,
        share_heads: bool,
        implementation: Implementation | None,
        relative_cross_attention: bool | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        attention: dict[str, Any] = dict(
            share_heads=share_heads, dropout=dropout, bias=bias, batch_first=batch_first,
            implementation=implementation, **factory,
        )
        self.self_attn = RelativeMultiheadAttention(
            d_model, nhead, max_distance, relative_keys=relative_keys,
            relative_values=relative_values, **attention,
        )
        decoder = relative_cross_attention is not None
        if decoder:
            cross = bool(relative_cross_attention)
            self.multihead_attn = RelativeMultiheadAttention(
                d_model, nhead, max_distance, relative_keys=relative_keys and cross,
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
        self.activation = _activation(activation)

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

    def _masks(
        self, x: object, mask: Tensor | None, padding: Tensor | None, key_mask: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """relpos's ``(attn_mask, key_mask)`` for attention from the layer input ``x``."""
        batch = _batch_size(x, self.self_attn.batch_first)
        return _relpos_masks(mask, padding, key_mask, batch, self.self_attn.num_heads)

    def _sa_block(
        self,
        x: Tensor,
        attn_mask: Tensor | None,
        key_mask: Tensor | None,
        is_causal: bool,
        cache: LayerCache | None,
    ) -> Tensor:
        out, _ = self.self_attn(
            x, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, cache=cache
        )
        return self.dropout1(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class RelativeTransformerEncoderLayer(_LayerBase):
    """``nn.TransformerEncoderLayer`` with relative self-attention.

    ``d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
    norm_first, bias, device, dtype`` are as in ``nn.TransformerEncoderLayer`` (inputs are
    ``(L, B, E)`` unless ``batch_first``, as in PyTorch).

    Args:
        max_distance: K, the clip distance.
        relative_keys, relative_values, share_heads: see :class:`RelativeMultiheadAttention`.
        implementation: backend (None = auto).

    Example:
        >>> layer = RelativeTransformerEncoderLayer(32, 4, 64, batch_first=True, max_distance=8)
        >>> nn.TransformerEncoder(layer, num_layers=2)(torch.randn(3, 11, 32)).shape
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
        max_distance: int = 16,
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
        cache: LayerCache | None = None,
    ) -> Tensor:
        """As ``nn.TransformerEncoderLayer.forward``; ``is_causal`` applies a causal mask.

        Args:
            src: ``(B, L, E)`` if ``batch_first`` else ``(L, B, E)``.
            src_mask: PyTorch's meaning: bool True = NOT allowed, or float (added);
                ``(L, S)`` or ``(B * H, L, S)``.
            src_key_padding_mask: ``(B, S)``, PyTorch's meaning: bool True = padding, or float
                (added).
            is_causal: key ``j`` visible to query ``i`` iff ``j <= p_i``.
            key_mask: ``(B, S)`` bool in relpos's meaning (True = real token), instead of
                ``src_key_padding_mask``.
            cache: a :class:`relpos.LayerCache`: ``src`` holds the ``t`` new tokens of an
                incremental step; their keys/values are appended and they attend over the
                whole cache (queries aligned to its end). The padding/key mask is then
                ``(B, t)`` for the new tokens and ``src_mask`` must broadcast to
                ``(B, H, t, S)``.

        Returns:
            Like ``src``.
        """
        attn_mask, key_mask = self._masks(src, src_mask, src_key_padding_mask, key_mask)
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), attn_mask, key_mask, is_causal, cache)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, attn_mask, key_mask, is_causal, cache))
            x = self.norm2(x + self._ff_block(x))
        return x


class RelativeTransformerDecoderLayer(_LayerBase):
    """``nn.TransformerDecoderLayer`` with relative self-attention.

    ``d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first,
    norm_first, bias, device, dtype`` are as in ``nn.TransformerDecoderLayer``.

    Args:
        max_distance: K, the clip distance.
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
        max_distance: int = 16,
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
            relative_cross_attention=bool(relative_cross_attention),
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
    ) -> Tensor:
        """As ``nn.TransformerDecoderLayer.forward``.

        Args:
            tgt: ``(B, L, E)`` if ``batch_first`` else ``(L, B, E)``.
            memory: ``(B, S, E)`` if ``batch_first`` else ``(S, B, E)``.
            tgt_mask, memory_mask: PyTorch's meaning: bool True = NOT allowed, or float
                (added); ``(L, L)``/``(L, S)`` or with a leading ``B * H``.
            tgt_key_padding_mask, memory_key_padding_mask: ``(B, L)``/``(B, S)``, PyTorch's
                meaning: bool True = padding, or float (added).
            tgt_is_causal, memory_is_causal: apply a causal mask in that attention.
            key_mask, memory_key_mask: ``(B, L)``/``(B, S)`` bool in relpos's meaning (True =
                real token), instead of the matching ``*_key_padding_mask``.
            cache: a :class:`relpos.LayerCache` for the self-attention: ``tgt`` holds the
                ``t`` new tokens of an incremental step (see
                :meth:`RelativeTransformerEncoderLayer.forward`); cross-attention still
                attends to the whole ``memory``.

        Returns:
            Like ``tgt``.
        """
        self_masks = self._masks(tgt, tgt_mask, tgt_key_padding_mask, key_mask)
        cross_masks = self._masks(tgt, memory_mask, memory_key_padding_mask, memory_key_mask)
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), *self_masks, tgt_is_causal, cache)
            x = x + self._mha_block(self.norm2(x), memory, *cross_masks, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, *self_masks, tgt_is_causal, cache))
            x = self.norm2(x + self._mha_block(x, memory, *cross_masks, memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _mha_block(
        self,
        x: Tensor,
        mem: Tensor,
        attn_mask: Tensor | None,
        key_mask: Tensor | None,
        is_causal: bool,
    ) -> Tensor:
        out, _ = self.multihead_attn(
            x, mem, mem, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal
        )
        return self.dropout2(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout3(x)
