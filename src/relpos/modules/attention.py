"""``RelativeMultiheadAttention``: ``nn.MultiheadAttention`` with clipped relative positions."""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from relpos.cache import LayerCache, PackedLayerCache
from relpos.functional import Implementation, relative_attention, relative_attention_with_weights
from relpos.modules._checks import (
    REQUIRED,
    check_bool,
    check_dropout,
    check_implementation,
    check_input_tensor,
    check_module_max_distance,
    check_optional_dim,
    check_positive_int,
    nn_masks_to_relpos,
)
from relpos.modules._state import check_saved_state, convert_old_projections
from relpos.versioning import check_state, make_state

__all__ = ["RelativeMultiheadAttention"]


class RelativeMultiheadAttention(nn.Module):
    r"""``nn.MultiheadAttention`` with Shaw et al. (2018) clipped relative position terms.

    A drop-in for ``nn.MultiheadAttention``: the same constructor arguments and defaults
    (``batch_first=False``), the same ``forward`` arguments, mask meanings (bool
    ``attn_mask`` True = NOT allowed, ``key_padding_mask`` True = padding, float masks
    added) and return value ``(attn_output, attn_weights or None)`` (weights averaged over
    heads unless ``average_attn_weights=False``), and the same parameter names
    (``in_proj_weight``/``in_proj_bias``, or ``q_proj_weight``/``k_proj_weight``/
    ``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``; ``out_proj``), so
    ``nn.MultiheadAttention``'s state dict loads with only the relative keys missing. With
    zero tables it computes exactly what ``nn.MultiheadAttention`` computes.

    On top of that: learned tables ``rel_keys``/``rel_values`` of ``R = 2K + 1`` rows
    (``(R, D)`` if ``share_heads`` else ``(H, R, D)``, ``D = embed_dim // num_heads``) whose
    row ``clip(j - p_i, -K, K) + K`` is added to key ``j`` and value ``j`` as seen from query
    ``i`` (see :func:`relpos.relative_attention`). With a window
    ``max_distance=(left, right)`` offsets are clipped to ``[-left, +right]``, the tables have
    ``R = left + right + 1`` rows and row ``clip(j - p_i, -left, right) + left`` is used.

    Args:
        embed_dim: E, the model dimension.
        num_heads: H; must divide ``embed_dim``.
        dropout: dropout on the attention probabilities (training mode only).
        bias: biases in the input and output projections.
        add_bias_kv: append a learned key and value row (as in ``nn.MultiheadAttention``).
            Only without relative terms: the appended rows have no position.
        add_zero_attn: append a zero key and value row; only without relative terms.
        kdim: features of ``key`` (default ``embed_dim``).
        vdim: features of ``value`` (default ``embed_dim``).
        batch_first: inputs are ``(B, L, E)`` (True) or ``(L, B, E)`` (False, the default,
            as in torch.nn).
        device, dtype: factory kwargs for the parameters.
        max_distance: K >= 0, the clip distance, or a window ``(left, right)`` of
            non-negative ints; required, keyword-only. Kept as given in
            :attr:`max_distance` (an int stays an int); :attr:`window` is ``(left, right)``.
        relative_keys: learn ``rel_keys`` (the key term).
        relative_values: learn ``rel_values`` (the value term).
        share_heads: one table for all heads (Shaw's choice) or one per head.
        implementation: backend for :func:`relpos.relative_attention` when
            ``need_weights=False`` (None = auto); returning weights always runs the bucketed
            backend.

    Example:
        >>> mha = RelativeMultiheadAttention(64, 4, batch_first=True, max_distance=8)
        >>> out, weights = mha(x := torch.randn(2, 10, 64), x, x)
        >>> out.shape, weights.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 10, 10]))
    """

    __constants__: ClassVar[list[str]] = ["batch_first"]

    embed_dim: int
    num_heads: int
    head_dim: int
    max_distance: int | tuple[int, int]
    relative_keys: bool
    relative_values: bool
    share_heads: bool
    dropout: float
    batch_first: bool
    kdim: int
    vdim: int
    add_zero_attn: bool
    implementation: Implementation | None
    in_proj_weight: nn.Parameter | None
    q_proj_weight: nn.Parameter | None
    k_proj_weight: nn.Parameter | None
    v_proj_weight: nn.Parameter | None
    in_proj_bias: nn.Parameter | None
    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None
    out_proj: NonDynamicallyQuantizableLinear
    rel_keys: nn.Parameter | None
    rel_values: nn.Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        max_distance: int | tuple[int, int] = REQUIRED,
        relative_keys: bool = True,
        relative_values: bool = True,
        share_heads: bool = True,
        implementation: Implementation | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        E = check_positive_int("embed_dim", embed_dim)
        H = check_positive_int("num_heads", num_heads)
        if E % H != 0:
            raise ValueError(
                f"embed_dim={E} is not divisible by num_heads={H}; "
                f"allowed: num_heads dividing embed_dim"
            )
        flags = {
            n: check_bool(n, v) for n, v in (
                ("bias", bias), ("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn),
                ("batch_first", batch_first), ("relative_keys", relative_keys),
                ("relative_values", relative_values), ("share_heads", share_heads),
            )
        }
        relative = flags["relative_keys"] or flags["relative_values"]
        D = E // H
        self.max_distance = check_module_max_distance(
            name, max_distance, dropout=dropout,
            table_columns=(D if flags["share_heads"] else H * D) if relative else None,
        )
        self.dropout = check_dropout(dropout)
        self.kdim = check_optional_dim("kdim", kdim, E)
        self.vdim = check_optional_dim("vdim", vdim, E)
        self.implementation = check_implementation(implementation)
        if relative and (flags["add_bias_kv"] or flags["add_zero_attn"]):
            raise ValueError(
                "add_bias_kv/add_zero_attn append key/value rows that have no position, so "
                "they have no relative term; allowed: add_bias_kv=add_zero_attn=False, or "
                "relative_keys=relative_values=False (then this is nn.MultiheadAttention)"
            )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = E, H, D
        self._qkv_same_embed_dim = self.kdim == E and self.vdim == E
        self.batch_first = flags["batch_first"]
        self.relative_keys = flags["relative_keys"]
        self.relative_values = flags["relative_values"]
        self.share_heads = flags["share_heads"]
        self.add_zero_attn = flags["add_zero_attn"]

        # nn.MultiheadAttention's parameters, under its names.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * E, E), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((E, E), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((E, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((E, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if flags["bias"]:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * E, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(E, E, bias=flags["bias"], **factory)
        if flags["add_bias_kv"]:
            self.bias_k = nn.Parameter(torch.empty((1, 1, E), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, E), **factory))
        else:
            self.bias_k = self.bias_v = None

        left, right = self.window
        rows = left + right + 1
        shape = (rows, D) if self.share_heads else (H, rows, D)
        self.rel_keys = nn.Parameter(torch.empty(shape, **factory)) if relative_keys else None
        self.rel_values = nn.Parameter(torch.empty(shape, **factory)) if relative_values else None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """nn.MultiheadAttention's initialization (Xavier-uniform input projection, zero
        biases, Xavier-normal ``bias_k``/``bias_v``); tables ~ N(0, 1/D) like a key/value."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)  # type: ignore[arg-type]
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)  # type: ignore[arg-type]
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        for b in (self.bias_k, self.bias_v):
            if b is not None:
                nn.init.xavier_normal_(b)
        std = 1.0 / math.sqrt(self.head_dim)
        for table in (self.rel_keys, self.rel_values):
            if table is not None:
                nn.init.normal_(table, std=std)

    @property
    def window(self) -> tuple[int, int]:
        """``(left, right)``: offsets are clipped to ``[-left, +right]`` (``(K, K)`` for a clip
        distance ``K``); the tables have ``left + right + 1`` rows."""
        m = self.max_distance
        return (m, m) if isinstance(m, int) else m

    def reset_parameters(self) -> None:
        """Re-initialize every parameter (see ``_reset_parameters``)."""
        self._reset_parameters()

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
            "dropout": self.dropout, "bias": self.in_proj_bias is not None,
            "add_bias_kv": self.bias_k is not None, "add_zero_attn": self.add_zero_attn,
            "kdim": self.kdim, "vdim": self.vdim, "batch_first": self.batch_first,
            "implementation": self.implementation,
        }

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> Tensor:
        """Saved as ``<prefix>._extra_state``: format version, clip window (``K`` or
        ``(left, right)``) and the offset convention.

        See :mod:`relpos.versioning`; loading checks it, so tables trained with another window
        or convention are never read silently with this module's meaning.
        """
        return make_state(self.max_distance)

    def set_extra_state(self, state: object) -> None:
        check_state(state, max_distance=self.max_distance, where=type(self).__name__)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
        error_msgs,
    ) -> None:
        convert_old_projections(self, state_dict, prefix)
        check_saved_state(self, state_dict, prefix)  # before any tensor is copied
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs,
        )

    # ------------------------------------------------------------------ forward
    def _check_input(self, name: str, x: object, features: int) -> Tensor:
        layout = "(B, N, F)" if self.batch_first else "(N, B, F)"
        t = check_input_tensor(
            name, x, like=self.out_proj.weight, ndims=(2, 3),
            layout=f"{layout} (or (N, F) unbatched) with F={features}",
        )
        if t.shape[-1] != features:
            raise ValueError(
                f"{name} must have shape {layout} (or (N, F) unbatched) with F={features}, "
                f"got {tuple(t.shape)}"
            )
        return t

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        key_mask: Tensor | None = None,
        query_start: int | None = None,
        cache: LayerCache | PackedLayerCache | None = None,
        cu_seqlens: Tensor | None = None,
        cu_seqlens_k: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """As ``nn.MultiheadAttention.forward``, with relative positions.

        Args:
            query: ``(L, B, E)``, ``(B, L, E)`` if ``batch_first``, or ``(L, E)`` unbatched.
            key: ``(S, B, kdim)`` (likewise); None = ``query`` (self-attention).
            value: ``(S, B, vdim)`` (likewise); None = ``key``.
            key_padding_mask: ``(B, S)`` (``(S,)`` unbatched): bool True = padding (ignored),
                or float (added to the scores), as in torch.nn.
            need_weights: also return the attention weights (default True, as in torch.nn;
                pass False for the fast backends).
            attn_mask: bool (True = NOT allowed) or float (added to the scores), as in
                torch.nn: ``(L, S)`` or ``(B * H, L, S)`` (``(H, L, S)`` unbatched), or 4-D
                broadcastable to ``(B, H, L, S)``.
            average_attn_weights: return the weights averaged over heads ``(B, L, S)``
                (True) or per head ``(B, H, L, S)``.
            is_causal: without ``attn_mask``, key ``j`` is visible to query ``i`` iff
                ``j <= p_i`` (relpos builds the mask; torch.nn would raise). With
                ``attn_mask`` it is torch.nn's hint that the mask is causal: the mask is
                used as given.
            key_mask: relpos's ``(B, S)`` bool key mask, True = real token, instead of
                ``key_padding_mask``.
            query_start: position of query 0 among the keys (default ``S - L``, queries
                aligned to the end of the keys).
            cache: incremental self-attention (``key``/``value`` None or ``query``): the
                ``t = L`` new tokens' keys/values are appended to the cache and the queries
                attend over all ``S`` cached positions, aligned to the end (query ``i`` at
                position ``S - t + i``). ``key_padding_mask``/``key_mask`` are then
                ``(B, t)`` bool masks of the new tokens (stored with the cache);
                ``attn_mask`` is ``(t, S)`` or ``(B * H, t, S)``. The cache stores detached
                tensors (inference).
            cu_seqlens: a packed batch (no padding): ``query`` is ``(Tq, E)``, the sequences
                end to end, and ``cu_seqlens`` ``(N + 1,)`` int32/int64 their boundaries (0,
                then each sequence's end; :func:`relpos.pack` makes both from a padded batch).
                Each sequence attends to itself only (see
                :func:`relpos.relative_attention_varlen`). No mask or ``query_start`` then,
                and no weights (None is returned for them). ``cache`` is then a
                :class:`relpos.PackedLayerCache` (self-attention): each sequence's new
                tokens are appended to its own cached keys and attend over them (aligned to
                their end), without padding.
            cu_seqlens_k: the boundaries of ``key``/``value`` ``(Tk, kdim)`` in a packed
                cross-attention; default ``cu_seqlens``.

        Returns:
            ``(attn_output, attn_weights)``: the output like ``query`` with ``E`` features,
            and the weights (before dropout) or None unless ``need_weights``. Rows that see no
            key give zeros, where torch.nn gives NaN.
        """
        if cu_seqlens is not None or cu_seqlens_k is not None:
            return self._forward_packed(
                query, key, value, cu_seqlens, cu_seqlens_k, is_causal=is_causal,
                cache=cache,
                unsupported={"key_padding_mask": key_padding_mask, "attn_mask": attn_mask,
                             "key_mask": key_mask, "query_start": query_start})
        for flag, given in (("need_weights", need_weights),
                            ("average_attn_weights", average_attn_weights),
                            ("is_causal", is_causal)):
            check_bool(flag, given)
        query = self._check_input("query", query, self.embed_dim)
        batched = query.dim() == 3
        self_attention = cache is not None or key is None or (key is query and (
            value is None or value is query))
        if cache is None:
            key, value = self._check_key_value(query, key, value)
        else:
            self._check_cache(cache, query, key, value)
            assert isinstance(cache, LayerCache)  # _check_cache refused anything else
            key = value = query
        query, key, value = (self._batch_first(x, batched) for x in (query, key, value))
        B, L, S_new = query.shape[0], query.shape[1], key.shape[1]
        S = S_new if cache is None else cache.length + S_new
        attn, kmask = nn_masks_to_relpos(
            attn_mask, key_padding_mask, key_mask, batch=B, heads=self.num_heads,
            query_len=L, key_len=S, batched=batched, pad_len=S_new, cached=cache is not None,
        )
        if attn_mask is not None:
            is_causal = False  # torch.nn's hint that attn_mask is causal: the mask decides
        q, k, v = self._in_projection(query, key, value, self_attention)
        q, k, v = (self._split_heads(t) for t in (q, k, v))  # (B, H, N, D)
        # With a cache, a refused step (e.g. a bad mask) leaves the cache as it was.
        with contextlib.nullcontext() if cache is None else cache.rollback_on_error():
            if cache is not None:
                k, v, kmask = cache.append(k, v, kmask)  # (B, H, S, D) each, (B, S)
            if self.bias_k is not None or self.add_zero_attn:
                k, v, attn, kmask, is_causal, query_start = self._append_rows(
                    k, v, attn, kmask, is_causal, query_start, L
                )
            out, weights = self.attend(
                q, k, v, attn_mask=attn, key_mask=kmask, is_causal=is_causal,
                need_weights=need_weights, query_start=query_start,
            )
        out = self.out_proj(out.transpose(1, 2).flatten(2))  # (B, L, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, L, S)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _forward_packed(
        self, query: Tensor, key: Tensor | None, value: Tensor | None,
        cu_seqlens: Tensor | None, cu_seqlens_k: Tensor | None, *, is_causal: bool,
        cache: object, unsupported: dict[str, object],
    ) -> tuple[Tensor, None]:
        """:meth:`forward` on a packed batch: ``(Tq, E)`` in and out."""
        from relpos.varlen import relative_attention_varlen

        check_bool("is_causal", is_causal)
        if cache is not None and not isinstance(cache, PackedLayerCache):
            raise TypeError(f"a packed call (cu_seqlens=...) takes a relpos.PackedLayerCache "
                            f"(one layer of a PackedKVCache), got {type(cache).__name__}")
        given = [name for name, v in unsupported.items() if v is not None]
        if given:
            raise ValueError(f"a packed call (cu_seqlens=...) takes no {', '.join(given)}: "
                             "its sequences carry no padding and each attends to itself only")
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_k was given without cu_seqlens (the query's "
                             "boundaries)")
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("a packed call (cu_seqlens=...) does not serve add_bias_kv or "
                             "add_zero_attn")
        for name, x, features in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                  ("value", value, self.vdim)):
            if x is not None:
                t = check_input_tensor(name, x, like=self.out_proj.weight, ndims=(2,),
                                       layout=f"(T, F) packed with F={features}")
                if t.shape[-1] != features:
                    raise ValueError(f"{name} must have shape (T, F) packed with F={features}, "
                                     f"got {tuple(t.shape)}")
        self_attention = key is None or (key is query and (value is None or value is query))
        key = query if key is None else key
        value = key if value is None else value
        if key.shape[0] != value.shape[0]:
            raise ValueError(f"key and value have {key.shape[0]} and {value.shape[0]} rows")
        if cache is not None and not (self_attention and cu_seqlens_k is None):
            raise ValueError("cache= serves packed self-attention only: pass key and value as "
                             "None and no cu_seqlens_k")
        q, k, v = self._in_projection(query, key, value, self_attention)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)) for t in (q, k, v))
        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        used = None
        # With a cache, a refused step (e.g. by attention) leaves the cache as it was.
        with (cache.rollback_on_error() if isinstance(cache, PackedLayerCache)
              else contextlib.nullcontext()):
            if isinstance(cache, PackedLayerCache):
                k, v, cu_k, used = cache.append(k, v, cu_seqlens)
            out = relative_attention_varlen(
                q, k, v, cu_seqlens, cu_k, max_distance=self.max_distance,
                rel_keys=self.rel_keys, rel_values=self.rel_values, is_causal=is_causal,
                dropout_p=self.dropout if self.training else 0.0,
                implementation=self.implementation, seqused_k=used,
            )  # (Tq, H, D)
        return self.out_proj(out.flatten(1)), None

    def _batch_first(self, x: Tensor, batched: bool) -> Tensor:
        if not batched:
            return x.unsqueeze(0)
        return x if self.batch_first else x.transpose(0, 1)

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _in_projection(
        self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(B, N, E)`` projections with nn.MultiheadAttention's weights."""
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if self.in_proj_weight is not None:
            if self_attention:
                q, k, v = F.linear(query, self.in_proj_weight, b).chunk(3, dim=-1)
                return q, k, v
            wq, wk, wv = self.in_proj_weight.chunk(3)
        else:
            assert self.q_proj_weight is not None and self.k_proj_weight is not None
            assert self.v_proj_weight is not None
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _append_rows(
        self, k: Tensor, v: Tensor, attn: Tensor | None, kmask: Tensor | None, is_causal: bool,
        query_start: int | None, L: int,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, bool, int | None]:
        """nn.MultiheadAttention's ``bias_k``/``bias_v`` and zero rows, appended after the
        keys and visible to every query (this module has no relative terms then)."""
        B, H, S, D = k.shape
        extra_k, extra_v = [], []
        if self.bias_k is not None and self.bias_v is not None:
            extra_k.append(self.bias_k.view(1, H, 1, D).expand(B, H, 1, D).to(k.dtype))
            extra_v.append(self.bias_v.view(1, H, 1, D).expand(B, H, 1, D).to(v.dtype))
        if self.add_zero_attn:
            extra_k.append(k.new_zeros(B, H, 1, D))
            extra_v.append(v.new_zeros(B, H, 1, D))
        n = len(extra_k)
        if is_causal:  # the causal mask over the real keys, explicit: the new rows stay visible
            start = S - L if query_start is None else query_start
            attn = torch.ones(L, S, dtype=torch.bool, device=k.device).tril(start)
            is_causal = False
        if attn is not None:
            pad = (0, n)
            attn = F.pad(attn, pad, value=True) if attn.dtype == torch.bool else F.pad(attn, pad)
        if kmask is not None:
            kmask = F.pad(kmask, (0, n), value=True)
        return (torch.cat([k, *extra_k], dim=2), torch.cat([v, *extra_v], dim=2), attn, kmask,
                is_causal, query_start)

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
        if not (query.dim() == key.dim() == value.dim()):
            raise ValueError(
                f"query, key and value must all be batched (3-D) or all unbatched (2-D), got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        b = 0 if self.batch_first else 1
        if query.dim() == 2:
            same = key.shape[0] == value.shape[0]
        else:
            same = key.shape[:2] == value.shape[:2] and key.shape[b] == query.shape[b]
        if not same:
            raise ValueError(
                f"query, key and value disagree on batch or length: {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        return key, value

    def _check_cache(
        self, cache: object, query: Tensor, key: Tensor | None, value: Tensor | None
    ) -> None:
        if not isinstance(cache, LayerCache):
            raise TypeError(
                f"cache must be a relpos.LayerCache (one layer of a KVCache, e.g. cache[i]), "
                f"got {type(cache).__name__}"
            )
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError(
                "cache= serves self-attention only: pass key and value as None (or as query)"
            )
        if not self._qkv_same_embed_dim:
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
        tables, in the functional API's conventions (bool ``attn_mask`` True = may attend,
        ``key_mask`` True = real token); returns ``(B, H, L, D)`` and the optional
        ``(B, H, L, S)`` weights."""
        kwargs = dict(
            max_distance=self.max_distance, rel_keys=self.rel_keys, rel_values=self.rel_values,
            attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0, query_start=query_start,
        )
        if need_weights:
            return relative_attention_with_weights(q, k, v, **kwargs)  # type: ignore[arg-type]
        out = relative_attention(q, k, v, implementation=self.implementation, **kwargs)  # type: ignore[arg-type]
        return out, None
