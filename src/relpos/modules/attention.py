"""``RelativeMultiheadAttention``: multi-head attention with clipped relative positions."""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any

import torch
from torch import Tensor, nn

from relpos.cache import LayerCache
from relpos.functional import Implementation, relative_attention, relative_attention_with_weights
from relpos.positions import check_max_distance
from relpos.versioning import RelativeStateError, check_state, make_state

__all__ = ["RelativeMultiheadAttention"]


class RelativeMultiheadAttention(nn.Module):
    r"""Multi-head attention with Shaw et al. (2018) clipped relative position representations.

    Projects ``query``/``key``/``value`` into ``num_heads`` heads of size ``D = embed_dim //
    num_heads`` and runs :func:`relpos.relative_attention` with learned tables ``rel_keys`` and
    ``rel_values`` of ``2K + 1`` rows (``(2K+1, D)`` if ``share_heads`` else ``(H, 2K+1, D)``).

    Args:
        embed_dim: E, the model dimension.
        num_heads: H; must divide ``embed_dim``.
        max_distance: K >= 0, the clip distance.
        relative_keys: learn ``rel_keys`` (the key term).
        relative_values: learn ``rel_values`` (the value term).
        share_heads: one table for all heads (Shaw's choice) or one per head.
        dropout: dropout on the attention probabilities (training mode only).
        bias: add biases to the input and output projections.
        kdim: size of ``key`` features (default ``embed_dim``).
        vdim: size of ``value`` features (default ``embed_dim``).
        batch_first: inputs are ``(B, L, E)`` (True) or ``(L, B, E)``.
        implementation: backend for :func:`relpos.relative_attention` (None = auto).
        device, dtype: factory kwargs for the parameters.

    Example:
        >>> mha = RelativeMultiheadAttention(64, 4, max_distance=8)
        >>> out, _ = mha(torch.randn(2, 10, 64), is_causal=True)
        >>> out.shape
        torch.Size([2, 10, 64])
    """

    embed_dim: int
    num_heads: int
    head_dim: int
    max_distance: int
    relative_keys: bool
    relative_values: bool
    share_heads: bool
    dropout: float
    batch_first: bool
    kdim: int
    vdim: int
    implementation: Implementation | None
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    out_proj: nn.Linear
    rel_keys: nn.Parameter | None
    rel_values: nn.Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_distance: int,
        *,
        relative_keys: bool = True,
        relative_values: bool = True,
        share_heads: bool = True,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        implementation: Implementation | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; "
                f"allowed: num_heads dividing embed_dim"
            )
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
            raise TypeError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.max_distance = check_max_distance(max_distance)
        self.relative_keys = bool(relative_keys)
        self.relative_values = bool(relative_values)
        self.share_heads = bool(share_heads)
        self.dropout = float(dropout)
        self.batch_first = bool(batch_first)
        self.kdim = int(kdim) if kdim is not None else self.embed_dim
        self.vdim = int(vdim) if vdim is not None else self.embed_dim
        self.implementation = implementation

        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, self.embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, self.embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias, **factory)
        rows = 2 * self.max_distance + 1
        shape = (rows, self.head_dim) if self.share_heads else (self.num_heads, rows, self.head_dim)
        self.rel_keys = nn.Parameter(torch.empty(shape, **factory)) if relative_keys else None
        self.rel_values = nn.Parameter(torch.empty(shape, **factory)) if relative_values else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections, zero biases; tables ~ N(0, 1/D) like a key/value vector."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        std = 1.0 / math.sqrt(self.head_dim)
        for table in (self.rel_keys, self.rel_values):
            if table is not None:
                nn.init.normal_(table, std=std)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"max_distance={self.max_distance}, relative_keys={self.relative_keys}, "
            f"relative_values={self.relative_values}, share_heads={self.share_heads}, "
            f"dropout={self.dropout}, batch_first={self.batch_first}"
        )

    def get_config(self) -> dict[str, Any]:
        """The constructor's keyword arguments that rebuild this module (``device``/``dtype``
        aside): ``type(mha)(**mha.get_config())`` is a freshly initialized twin.

        Example:
            >>> mha = RelativeMultiheadAttention(64, 4, max_distance=8, share_heads=False)
            >>> RelativeMultiheadAttention(**mha.get_config()).rel_keys.shape
            torch.Size([4, 17, 16])
        """
        return {
            "embed_dim": self.embed_dim, "num_heads": self.num_heads,
            "max_distance": self.max_distance, "relative_keys": self.relative_keys,
            "relative_values": self.relative_values, "share_heads": self.share_heads,
            "dropout": self.dropout, "bias": self.q_proj.bias is not None, "kdim": self.kdim,
            "vdim": self.vdim, "batch_first": self.batch_first,
            "implementation": self.implementation,
        }

    def get_extra_state(self) -> Tensor:
        """Saved as ``<prefix>._extra_state``: format version, K and the offset convention.

        See :mod:`relpos.versioning`; loading checks it, so tables trained with another K or
        convention are never read silently with this module's meaning.
        """
        return make_state(self.max_distance)

    def set_extra_state(self, state: object) -> None:
        check_state(state, max_distance=self.max_distance, where=type(self).__name__)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
        error_msgs,
    ) -> None:
        # Check K and the convention before any tensor is copied, naming the module.
        where = prefix[:-1] or type(self).__name__
        state_key = prefix + "_extra_state"
        if state_key in state_dict:
            check_state(state_dict[state_key], max_distance=self.max_distance, where=where)
        rows = 2 * self.max_distance + 1
        for name in ("rel_keys", "rel_values"):
            saved = state_dict.get(prefix + name)
            if (
                getattr(self, name) is not None and isinstance(saved, Tensor)
                and saved.dim() in (2, 3) and saved.shape[-2] != rows
            ):
                raise RelativeStateError(
                    f"{prefix + name}: the saved table has {saved.shape[-2]} rows (shape "
                    f"{tuple(saved.shape)}) but this module has max_distance="
                    f"{self.max_distance} ({rows} rows); to load it anyway use "
                    f"relpos.load_state_dict_resized(module, state_dict)"
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs,
        )

    def _split_heads(self, x: Tensor) -> Tensor:
        B, N, _ = x.shape
        return x.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)

    def _check_input(self, name: str, x: object, features: int) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        layout = "(B, N, F)" if self.batch_first else "(N, B, F)"
        if x.dim() != 3 or x.shape[-1] != features:
            raise ValueError(
                f"{name} must have shape {layout} with F={features}, got {tuple(x.shape)}"
            )
        return x

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        query_start: int | None = None,
        cache: LayerCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when ``key`` is None).

        Args:
            query: ``(B, L, E)`` (or ``(L, B, E)`` if not ``batch_first``).
            key: ``(B, S, kdim)``; None = ``query`` (self-attention).
            value: ``(B, S, vdim)``; None = ``key``.
            attn_mask: bool (True = may attend) or float (added), broadcastable to
                ``(B, H, L, S)``, e.g. ``(L, S)``.
            key_mask: ``(B, S)`` bool, True = real token.
            is_causal: key ``j`` visible to query ``i`` iff ``j <= p_i``.
            need_weights: also return the attention probabilities ``(B, H, L, S)``.
            query_start: position of query 0 among the keys (default ``S - L``).
            cache: incremental self-attention (``key`` and ``value`` must be None). The ``t =
                L`` new tokens' keys/values are appended to the cache and the queries attend
                over all ``S`` cached positions, aligned to the end (query ``i`` at position
                ``S - t + i``). ``key_mask`` is then ``(B, t)`` for the new tokens only (it is
                stored with the cache); ``attn_mask`` must broadcast to ``(B, H, t, S)``. The
                cache stores detached tensors (inference).

        Returns:
            ``(out, weights)``: ``out`` like ``query`` with ``E`` features; ``weights`` is None
            unless ``need_weights``.
        """
        query = self._check_input("query", query, self.embed_dim)
        if cache is None:
            key, value = self._check_key_value(query, key, value)
        else:
            self._check_cache(cache, key, value)
            key = value = query
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        q = self._split_heads(self.q_proj(query))  # (B, H, L, D)
        k = self._split_heads(self.k_proj(key))  # (B, H, S, D), or (B, H, t, D) new ones
        v = self._split_heads(self.v_proj(value))  # (B, H, S, D), or (B, H, t, D) new ones
        # With a cache, a refused step (e.g. a bad mask) leaves the cache as it was.
        with contextlib.nullcontext() if cache is None else cache.rollback_on_error():
            if cache is not None:
                k, v, key_mask = cache.append(k, v, key_mask)  # (B, H, S, D) each, (B, S)
            out, weights = self.attend(
                q, k, v, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
                need_weights=need_weights, query_start=query_start,
            )
        B, _, L, _ = out.shape
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))  # (B, L, E)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _check_key_value(
        self, query: Tensor, key: Tensor | None, value: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``key``/``value`` after their defaults (self-attention) and shape checks."""
        if key is None:
            if self.kdim != self.embed_dim:
                raise ValueError("key=None (self-attention) needs kdim == embed_dim")
            key = query
        key = self._check_input("key", key, self.kdim)
        if value is None:
            if self.vdim != self.kdim:
                raise ValueError("value=None needs vdim == kdim")
            value = key
        value = self._check_input("value", value, self.vdim)
        b = 0 if self.batch_first else 1
        if key.shape[:2] != value.shape[:2] or key.shape[b] != query.shape[b]:
            raise ValueError(
                f"query, key and value disagree on batch or length: {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        return key, value

    def _check_cache(self, cache: object, key: Tensor | None, value: Tensor | None) -> None:
        if not isinstance(cache, LayerCache):
            raise TypeError(
                f"cache must be a relpos.LayerCache (one layer of a KVCache, e.g. cache[i]), "
                f"got {type(cache).__name__}"
            )
        if key is not None or value is not None:
            raise ValueError("cache= serves self-attention only: pass key=None and value=None")
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            raise ValueError(
                "cache= serves self-attention only, which needs kdim == vdim == embed_dim"
            )

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        query_start: int | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention over projected heads ``(B, H, L, D)``/``(B, H, S, D)`` with this module's
        tables; returns ``(B, H, L, D)`` and the optional ``(B, H, L, S)`` weights."""
        kwargs = dict(
            max_distance=self.max_distance, rel_keys=self.rel_keys, rel_values=self.rel_values,
            attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0, query_start=query_start,
        )
        if need_weights:
            return relative_attention_with_weights(q, k, v, **kwargs)  # type: ignore[arg-type]
        out = relative_attention(q, k, v, implementation=self.implementation, **kwargs)  # type: ignore[arg-type]
        return out, None
