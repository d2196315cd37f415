"""Drop-in replacements for ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``.

Same constructor arguments, forward signatures and mask meanings as PyTorch's layers (so they
work inside ``nn.TransformerEncoder`` / ``nn.TransformerDecoder``): boolean ``*_mask`` True =
NOT allowed and ``*_key_padding_mask`` True = padding, as in PyTorch. Self-attention uses
clipped relative positions; cross-attention is plain unless ``relative_cross_attention``.
"""

from __future__ import annotations

from collections.abc import Callable

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


def _torch_masks(
    mask: Tensor | None, padding_mask: Tensor | None, batch: int, heads: int
) -> tuple[Tensor | None, Tensor | None]:
    """PyTorch's mask meanings -> relpos's: (attn_mask True = may attend, key_mask True = real)."""
    for name, m in (("attention mask", mask), ("key padding mask", padding_mask)):
        if m is not None and not isinstance(m, Tensor):
            raise TypeError(f"the {name} must be a torch.Tensor or None, got {type(m).__name__}")
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
    key_mask = None
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
    def _init_common(
        self,
        d_model: int,
        dim_feedforward: int,
        dropout: float,
        activation: Activation,
        layer_norm_eps: float,
        norm_first: bool,
        bias: bool,
        factory: dict[str, object],
    ) -> None:
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)  # type: ignore[arg-type]
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)  # type: ignore[arg-type]
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = _activation(activation)

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
        super().__init__()
        factory: dict[str, object] = {"device": device, "dtype": dtype}
        self.self_attn = RelativeMultiheadAttention(
            d_model, nhead, max_distance, relative_keys=relative_keys,
            relative_values=relative_values, share_heads=share_heads, dropout=dropout,
            bias=bias, batch_first=batch_first, implementation=implementation,
            device=device, dtype=dtype,
        )
        self._init_common(
            d_model, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias, factory
        )

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """As ``nn.TransformerEncoderLayer.forward``; ``is_causal`` applies a causal mask.

        With ``cache`` (a :class:`relpos.LayerCache`), ``src`` holds the ``t`` new tokens of an
        incremental step: their keys/values are appended and they attend over the whole cache
        (queries aligned to its end); ``src_key_padding_mask`` is then ``(B, t)`` for the new
        tokens and ``src_mask`` must broadcast to ``(B, H, t, S)``.
        """
        x = src
        if self.norm_first:
            x = x + self._sa_block(
                self.norm1(x), src_mask, src_key_padding_mask, is_causal, cache=cache
            )
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(
                x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal, cache=cache)
            )
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(
        self,
        x: Tensor,
        mask: Tensor | None,
        padding: Tensor | None,
        is_causal: bool,
        *,
        cache: LayerCache | None = None,
    ) -> Tensor:
        batch = _batch_size(x, self.self_attn.batch_first)
        attn_mask, key_mask = _torch_masks(mask, padding, batch, self.self_attn.num_heads)
        out, _ = self.self_attn(
            x, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, cache=cache
        )
        return self.dropout1(out)


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
        super().__init__()
        factory: dict[str, object] = {"device": device, "dtype": dtype}
        self.self_attn = RelativeMultiheadAttention(
            d_model, nhead, max_distance, relative_keys=relative_keys,
            relative_values=relative_values, share_heads=share_heads, dropout=dropout,
            bias=bias, batch_first=batch_first, implementation=implementation,
            device=device, dtype=dtype,
        )
        cross_relative = bool(relative_cross_attention)
        self.multihead_attn = RelativeMultiheadAttention(
            d_model, nhead, max_distance, relative_keys=relative_keys and cross_relative,
            relative_values=relative_values and cross_relative, share_heads=share_heads,
            dropout=dropout, bias=bias, batch_first=batch_first,
            implementation=implementation, device=device, dtype=dtype,
        )
        self._init_common(
            d_model, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias, factory
        )
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)  # type: ignore[arg-type]
        self.dropout3 = nn.Dropout(dropout)

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
        cache: LayerCache | None = None,
    ) -> Tensor:
        """As ``nn.TransformerDecoderLayer.forward``.

        With ``cache`` (a :class:`relpos.LayerCache` for the self-attention), ``tgt`` holds the
        ``t`` new tokens of an incremental step (see
        :meth:`RelativeTransformerEncoderLayer.forward`); cross-attention still attends to the
        whole ``memory``.
        """
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(
                self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal, cache=cache
            )
            x = x + self._mha_block(
                self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal
            )
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(
                x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal, cache=cache)
            )
            x = self.norm2(
                x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask,
                                    memory_is_causal)
            )
            x = self.norm3(x + self._ff_block(x))
        return x

    def _batch(self, x: Tensor) -> int:
        return _batch_size(x, self.self_attn.batch_first)

    def _sa_block(
        self,
        x: Tensor,
        mask: Tensor | None,
        padding: Tensor | None,
        is_causal: bool,
        *,
        cache: LayerCache | None = None,
    ) -> Tensor:
        attn_mask, key_mask = _torch_masks(mask, padding, self._batch(x), self.self_attn.num_heads)
        out, _ = self.self_attn(
            x, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, cache=cache
        )
        return self.dropout1(out)

    def _mha_block(
        self,
        x: Tensor,
        mem: Tensor,
        mask: Tensor | None,
        padding: Tensor | None,
        is_causal: bool,
    ) -> Tensor:
        attn_mask, key_mask = _torch_masks(mask, padding, self._batch(x), self.self_attn.num_heads)
        out, _ = self.multihead_attn(
            x, mem, mem, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal
        )
        return self.dropout2(out)

    def _ff_block(self, x: Tensor) -> Tensor:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout3(x)
