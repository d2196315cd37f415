"""Small reference models: a decoder-only language model and a bidirectional encoder.

Shape legend: B batch, L tokens in the call, S cached positions, E ``d_model``, V vocabulary,
C ``num_classes``.

Both are stacks of pre-norm blocks (:class:`relpos.RelativeTransformerEncoderLayer` with
``norm_first=True``: self-attention + GELU MLP) over token embeddings, with no absolute
positions unless the config asks for an absolute baseline (``positions="learned"`` or
``"sinusoidal"``, in which case the attention layers have no relative terms).
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from relpos.cache import KVCache, PackedKVCache
from relpos.models.config import ModelConfig
from relpos.models.decoding import StepDecoder, sinusoidal_positions
from relpos.models.generation import (
    check_generation_memory,
    check_max_new_tokens,
    check_sampling,
    check_tokens,
    packed_steps,
    padded_from_packed,
    sample,
)
from relpos.modules.transformer_layers import RelativeTransformerEncoderLayer
from relpos.varlen import cu_seqlens_from_lengths

__all__ = ["RelativeTransformerEncoderModel", "RelativeTransformerLM", "build_model"]


class _Backbone(nn.Module):
    """Embeddings + blocks + final norm, shared by both models."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(
                f"config must be a relpos.models.ModelConfig, got {type(config).__name__}"
            )
        self.config = config  # validated when it was made (ModelConfig.__post_init__)
        E = config.d_model
        self.embed = nn.Embedding(config.vocab_size, E)
        self.pos_embed = (
            nn.Embedding(config.max_length, E) if config.positions == "learned" else None
        )
        self.emb_dropout = nn.Dropout(config.dropout)
        rel = config.uses_relative
        self.layers = nn.ModuleList(
            RelativeTransformerEncoderLayer(
                E, config.num_heads, config.ffn_dim, config.dropout, activation="gelu",
                batch_first=True, norm_first=True, max_distance=config.max_distance,
                relative_keys=rel and config.relative_keys,
                relative_values=rel and config.relative_values,
                share_heads=config.share_heads,
            )
            for _ in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(E)
        self.head = (
            nn.Linear(E, config.num_classes) if config.num_classes is not None else None
        )
        nn.init.normal_(self.embed.weight, std=E**-0.5)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed.weight, std=1.0)

    def get_config(self) -> dict[str, Any]:
        """The constructor's keyword arguments that rebuild this model:
        ``type(model)(**model.get_config())`` is a freshly initialized twin.

        Returns:
            ``{"config": ModelConfig}`` (a copy of :attr:`config`).
        """
        return {"config": copy.copy(self.config)}

    def check_ids(self, ids: object, key_mask: object) -> Tensor:
        if not isinstance(ids, Tensor):
            raise TypeError(f"ids must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"ids must have an integer dtype (torch.long), got {ids.dtype}")
        if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape (B, L) with B, L >= 1, got {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(
                f"ids must be in [0, vocab_size={self.config.vocab_size}), "
                f"got values in [{lo}, {hi}]"
            )
        if key_mask is not None:
            if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
                got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
                raise TypeError(f"key_mask must be a bool tensor (True = real token), got {got}")
            if key_mask.shape != ids.shape:
                raise ValueError(
                    f"key_mask must have the shape of ids {tuple(ids.shape)}, "
                    f"got {tuple(key_mask.shape)}"
                )
        return ids.long()

    def check_length(self, start: int, length: int) -> None:
        cfg = self.config
        if cfg.positions == "learned" and start + length > cfg.max_length:
            raise ValueError(
                f"positions {start}..{start + length - 1} exceed max_length={cfg.max_length} "
                f"of the learned absolute positions"
            )

    def hidden(
        self, ids: Tensor, key_mask: Tensor | None, cache: KVCache | None, is_causal: bool
    ) -> Tensor:
        """Final normalized hidden states ``(B, L, E)`` of validated ids."""
        L = ids.shape[1]
        start = 0 if cache is None else cache.length
        self.check_length(start, L)
        E = self.config.d_model
        x = self.embed(ids) * math.sqrt(E)  # (B, L, E)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(start, start + L, device=ids.device))
        elif self.config.positions == "sinusoidal":
            x = x + sinusoidal_positions(start, L, E, device=x.device, dtype=x.dtype)
        x = self.emb_dropout(x)
        for i, layer in enumerate(self.layers):
            x = layer(
                x, key_mask=key_mask, is_causal=is_causal,
                cache=None if cache is None else cache[i],
            )
        return self.norm(x)

    def check_packed(self, ids: object, cu_seqlens: object) -> tuple[Tensor, Tensor]:
        """Validated packed ids ``(T,)`` and boundaries ``(N + 1,)`` int64 (as
        :func:`relpos.relative_attention_varlen` checks them)."""
        from relpos.varlen import _check_cu_seqlens

        if not isinstance(ids, Tensor):
            raise TypeError(f"ids must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"ids must have an integer dtype (torch.long), got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"packed ids (cu_seqlens=...) must have shape (T,), the sequences "
                             f"end to end, got {tuple(ids.shape)}")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"ids must be in [0, vocab_size={self.config.vocab_size}), "
                                 f"got values in [{lo}, {hi}]")
        cu, lengths = _check_cu_seqlens("cu_seqlens", cu_seqlens, ids.shape[0], tracing=False)
        assert lengths is not None
        self.check_length(0, max(lengths, default=0))
        return ids.long(), cu

    def hidden_packed(self, ids: Tensor, cu_seqlens: Tensor, is_causal: bool,
                      cache: PackedKVCache | None = None) -> Tensor:
        """Final normalized hidden states ``(T, E)`` of validated packed ids: each sequence
        from position 0 (or after its cached tokens), attending to itself only."""
        E = self.config.d_model
        x = self.embed(ids) * math.sqrt(E)  # (T, E)
        if self.config.positions in ("learned", "sinusoidal"):
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(ids.device)
            starts = torch.repeat_interleave(cu_seqlens[:-1].to(ids.device), lengths)
            positions = torch.arange(ids.shape[0], device=ids.device) - starts  # (T,)
            if cache is not None:
                cached = torch.tensor(cache.lengths, device=ids.device)
                positions = positions + torch.repeat_interleave(cached, lengths)
            if self.pos_embed is not None:
                x = x + self.pos_embed(positions)
            else:
                longest = int(positions.max()) + 1 if positions.numel() else 0
                table = sinusoidal_positions(0, longest, E, device=x.device, dtype=x.dtype)
                x = x + table[positions]
        x = self.emb_dropout(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, is_causal=is_causal, cu_seqlens=cu_seqlens,
                      cache=None if cache is None else cache[i])
        return self.norm(x)

    def logits(self, h: Tensor) -> Tensor:
        if self.head is not None:
            return self.head(h)
        return h @ self.embed.weight.t()  # (..., V), tied to the embedding


class RelativeTransformerLM(_Backbone):
    """Decoder-only language model with clipped relative self-attention.

    Token embedding (scaled by ``sqrt(E)``), ``num_layers`` pre-norm causal blocks, final
    LayerNorm and an output head tied to the embedding (or a separate ``num_classes`` head).
    With ``positions="relative"`` there are no absolute positions: a model trained on short
    sequences runs on any length.

    Args:
        config: a :class:`ModelConfig` with ``causal=True``.

    Example:
        >>> model = RelativeTransformerLM(ModelConfig(vocab_size=50, max_distance=4))
        >>> model(torch.randint(0, 50, (2, 9))).shape
        torch.Size([2, 9, 50])
        >>> model.generate(torch.zeros(1, 3, dtype=torch.long), 5, top_k=1).shape
        torch.Size([1, 8])
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if not config.causal:
            raise ValueError(
                "RelativeTransformerLM needs ModelConfig.causal=True; for causal=False use "
                "RelativeTransformerEncoderModel (or build_model)"
            )

    def new_cache(self, *, capacity: int | None = None, growable: bool = True) -> KVCache:
        """An empty :class:`relpos.KVCache` with one layer cache per block."""
        return KVCache(len(self.layers), capacity=capacity, growable=growable)

    def new_packed_cache(self, num_sequences: int, *, capacity: int | None = None,
                         growable: bool = True) -> PackedKVCache:
        """An empty :class:`relpos.PackedKVCache` of ``num_sequences`` sequences, one layer
        cache per block."""
        return PackedKVCache(len(self.layers), num_sequences, capacity=capacity,
                             growable=growable)

    @torch.no_grad()
    def generate_packed(
        self,
        prompts: Sequence[Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> list[Tensor]:
        """Continue prompts of different lengths together: one packed prefill pass over every
        prompt (no padding, through a :class:`relpos.PackedKVCache`), then one token a step on
        :meth:`generate`'s fast decoder (:class:`relpos.models.decoding.StepDecoder`), the
        prompts left-padded to the longest in its static cache with a key mask over the
        padding (queries align to the end of the keys: each prompt keeps its own relative
        offsets, and its own absolute positions). A sequence that produced an end token
        appends nothing more; finished sequences leave the step cache when that halves a
        step's attention work.

        Greedy, each sequence's tokens are those of :meth:`generate` on that prompt alone.
        Sampling draws what :meth:`generate` draws for the N prompts as one batch (a row per
        prompt, in order, finished ones included), so the same generator gives the tokens of
        :meth:`generate` on the stacked prompts when they have equal lengths, and on the
        left-padded batch with its ``key_mask`` when they do not and the model has no
        absolute positions (left padding shifts :meth:`generate`'s absolute positions);
        end tokens or not. (The packed prefill equals the padded one up to rounding.)

        Args:
            prompts: N ``(P_s,)`` token id tensors, ``P_s >= 1``.
            max_new_tokens, temperature, top_k, top_p, eos_token_id, generator: as in
                :meth:`generate`.

        Returns:
            N ``(n_s,)`` tensors of new tokens, ``n_s <= max_new_tokens`` (a sequence stops
            after its end token, which it includes).

        Raises:
            TypeError, ValueError: on bad arguments, or if the model has a ``num_classes`` head.
        """
        if self.head is not None:
            raise ValueError(
                "generate_packed needs the tied vocabulary head (ModelConfig.num_classes=None), "
                f"this model has num_classes={self.config.num_classes}")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError(f"prompts must be a non-empty list of (P,) token id tensors, got "
                            f"{type(prompts).__name__}")
        for s, p in enumerate(prompts):
            if not isinstance(p, Tensor) or p.dim() != 1 or p.numel() == 0:
                got = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
                raise ValueError(f"prompts[{s}] must be a (P,) tensor of token ids with P >= 1, "
                                 f"got {got}")
        n_max = check_max_new_tokens(max_new_tokens)
        sampling = check_sampling(temperature, top_k, top_p, generator)
        stop = check_tokens("eos_token_id", eos_token_id, self.config.vocab_size)
        N, lengths = len(prompts), [int(p.numel()) for p in prompts]
        P = max(lengths)
        self.check_length(0, P + n_max)
        if n_max == 0:
            return [torch.zeros(0, dtype=torch.long) for _ in range(N)]
        check_generation_memory(self, N, P, n_max)
        ids = torch.cat([p.to(self.embed.weight.device) for p in prompts])
        cu = cu_seqlens_from_lengths(lengths)
        packed = self.new_packed_cache(N, capacity=P, growable=False)
        was_training = self.training
        self.eval()
        try:
            logits = self(ids, cu_seqlens=cu, cache=packed)[cu[1:] - 1]  # (N, V)
            cache = padded_from_packed(packed, lengths, P + n_max - 1)
            del packed
            absolute = self.config.positions in ("learned", "sinusoidal")
            out = packed_steps(StepDecoder(self), cache, logits, lengths, n_max, sampling, stop,
                               absolute)
        finally:
            self.train(was_training)
        return [torch.tensor(o, dtype=torch.long) for o in out]

    def forward(
        self, ids: Tensor, *, key_mask: Tensor | None = None, cache: KVCache | None = None,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """Next-token logits.

        Args:
            ids: ``(B, L)`` token ids (integer dtype, in ``[0, vocab_size)``); ``(T,)``
                packed with ``cu_seqlens``.
            key_mask: ``(B, L)`` bool, True = real token (e.g. False on left padding).
            cache: a :class:`relpos.KVCache` from :meth:`new_cache`: ``ids`` are the ``L`` new
                tokens at positions ``cache.length ..``; their keys/values are appended (and
                ``key_mask`` stored with them). The output equals the matching rows of a
                full forward pass over the whole sequence. A refused call leaves the cache
                unchanged.
            cu_seqlens: a packed batch (no padding): ``ids`` ``(T,)`` holds the sequences
                end to end and ``cu_seqlens`` ``(N + 1,)`` their boundaries
                (:func:`relpos.pack`); each sequence starts at position 0 and attends to
                itself only. No ``key_mask`` then; ``cache`` is a
                :class:`relpos.PackedKVCache` of N sequences (:meth:`new_packed_cache`):
                each sequence's new tokens follow its cached ones (a sequence may bring
                none).

        Returns:
            ``(B, L, V)`` logits (``(B, L, C)`` with ``num_classes``); ``(T, V)`` packed.

        Raises:
            TypeError, ValueError: on bad ids, masks, lengths or a mismatched cache.
        """
        if cu_seqlens is not None:
            if key_mask is not None:
                raise ValueError("a packed call (cu_seqlens=...) takes no key_mask")
            if cache is not None and not isinstance(cache, PackedKVCache):
                raise TypeError(f"a packed call (cu_seqlens=...) takes a relpos.PackedKVCache, "
                                f"got {type(cache).__name__}")
            ids, cu = self.check_packed(ids, cu_seqlens)
            if cache is not None:
                if (cache.num_layers, cache.num_sequences) != (len(self.layers), len(cu) - 1):
                    raise ValueError(
                        f"the cache holds {cache.num_layers} layers of {cache.num_sequences} "
                        f"sequences; the model has {len(self.layers)} layers and the step "
                        f"{len(cu) - 1} sequences")
                new = (cu[1:] - cu[:-1]).tolist()
                cache.check_step(new)
                self.check_length(0, max((c + t for c, t in zip(cache.lengths, new,
                                                                strict=True)), default=0))
                # A step that fails part-way (in any layer) leaves every layer as it was.
                with cache.rollback_on_error():
                    return self.logits(self.hidden_packed(ids, cu, is_causal=True, cache=cache))
            return self.logits(self.hidden_packed(ids, cu, is_causal=True))
        ids = self.check_ids(ids, key_mask)
        if cache is None:
            return self.logits(self.hidden(ids, key_mask, None, is_causal=True))
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a relpos.KVCache, got {type(cache).__name__}")
        if cache.num_layers != len(self.layers):
            raise ValueError(
                f"cache has {cache.num_layers} layers but the model has {len(self.layers)}"
            )
        B, L = ids.shape
        cache.check_step(B, L)
        self.check_length(cache.length, L)
        with cache.rollback_on_error():  # leave the cache as it was before a refused step
            return self.logits(self.hidden(ids, key_mask, cache, is_causal=True))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        new_tokens_only: bool = False,
        generator: torch.Generator | None = None,
        key_mask: Tensor | None = None,
    ) -> Tensor:
        """Sample a continuation: one prefill pass over the prompt, then one token a step.

        The steps run on :class:`relpos.models.decoding.StepDecoder` (one fused QKV
        projection, a static preallocated cache and one attention call per layer); the
        result equals decoding through the modules (``model(token, cache=cache)``). Runs in
        eval mode (restored afterwards) without gradients.

        Args:
            prompt_ids: ``(B, P)`` token ids.
            max_new_tokens: N >= 0, the most tokens to add.
            temperature: divides the logits; 0 = greedy (argmax).
            top_k: sample among the ``top_k`` most likely tokens (1 = greedy); None = all.
            top_p: nucleus sampling: among the most likely tokens whose probabilities sum to
                at least ``top_p`` (in (0, 1]); None = all. Applied after ``top_k``.
            eos_token_id: a stop token (or several): a sequence that emits one is finished,
                and generation stops early once every sequence is.
            pad_token_id: the token that fills a finished sequence's later positions
                (default: ``eos_token_id``, its first one if several).
            new_tokens_only: return only the generated tokens ``(B, n)``.
            generator: a ``torch.Generator`` for reproducible sampling.
            key_mask: ``(B, P)`` bool, True = real prompt token (False on left padding).

        Returns:
            ``(B, P + n)``: the prompt followed by the generated tokens, ``n <= N`` (fewer when
            every sequence stopped); ``(B, n)`` with ``new_tokens_only``.

        Raises:
            TypeError, ValueError: on bad arguments, or if the model has a ``num_classes`` head.
        """
        if self.head is not None:
            raise ValueError(
                "generate needs the tied vocabulary head (ModelConfig.num_classes=None), "
                f"this model has num_classes={self.config.num_classes}"
            )
        ids = self.check_ids(prompt_ids, key_mask)
        N = check_max_new_tokens(max_new_tokens)
        sampling = check_sampling(temperature, top_k, top_p, generator)
        stop = check_tokens("eos_token_id", eos_token_id, self.config.vocab_size)
        if pad_token_id is not None and (
            isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral)
        ):
            raise TypeError(f"pad_token_id must be one int token id, got {pad_token_id!r}")
        pads = check_tokens("pad_token_id", pad_token_id, self.config.vocab_size)
        if not isinstance(new_tokens_only, bool):
            raise TypeError(f"new_tokens_only must be a bool, got {new_tokens_only!r}")
        pad = pads[0] if pads else (stop[0] if stop else None)
        P = ids.shape[1]
        self.check_length(0, P + N)
        check_generation_memory(self, ids.shape[0], P, N)
        if N == 0:
            return ids[:, :0] if new_tokens_only else ids
        cache = self.new_cache(capacity=P + N, growable=False)
        was_training = self.training
        self.eval()
        try:
            logits = self(ids, key_mask=key_mask, cache=cache)[:, -1]  # (B, V)
            step = StepDecoder(self)
            step.start(cache)
            stop_ids = torch.tensor(stop, device=ids.device) if stop else None
            done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
            out: list[Tensor] = []
            for n in range(N):
                token = sample(logits, *sampling)  # (B,)
                if stop_ids is not None:
                    if pad is not None:
                        token = token.masked_fill(done, pad)
                    done = done | torch.isin(token, stop_ids)
                out.append(token)
                if n + 1 == N or (stop_ids is not None and bool(done.all())):
                    break
                logits = step(token, cache)
        finally:
            self.train(was_training)
        new = torch.stack(out, dim=1)  # (B, n)
        return new if new_tokens_only else torch.cat([ids, new], dim=1)


class RelativeTransformerEncoderModel(_Backbone):
    """Bidirectional encoder for classification and tagging, with relative self-attention.

    Same blocks as :class:`RelativeTransformerLM` without the causal mask (when
    ``config.causal`` is False; a causal config gives a left-to-right tagger). The head is
    tied to the embedding (``num_classes=None``, e.g. masked-token prediction) or a
    separate linear layer with ``num_classes`` outputs.

    Args:
        config: a :class:`ModelConfig`.

    Example:
        >>> cfg = ModelConfig(vocab_size=20, causal=False, num_classes=3, max_distance=4)
        >>> model = RelativeTransformerEncoderModel(cfg)
        >>> ids = torch.randint(0, 20, (2, 7))
        >>> model(ids).shape, model(ids, pool="mean").shape
        (torch.Size([2, 7, 3]), torch.Size([2, 3]))
    """

    def forward(
        self,
        ids: Tensor,
        *,
        key_mask: Tensor | None = None,
        cache: KVCache | None = None,
        pool: Literal["mean", "first"] | None = None,
        cu_seqlens: Tensor | None = None,
    ) -> Tensor:
        """Per-token or pooled logits.

        Args:
            ids: ``(B, L)`` token ids; ``(T,)`` packed with ``cu_seqlens``.
            key_mask: ``(B, L)`` bool, True = real token (padding is neither attended nor
                pooled).
            cache: must be None (a bidirectional encoder sees the whole sequence at once).
            pool: None = per-token logits; ``"mean"`` = mean of the final hidden states over
                the real tokens, ``"first"`` = the first token's state, then the head.
            cu_seqlens: a packed batch: ``ids`` ``(T,)``, the sequences end to end, and
                their boundaries ``(N + 1,)`` (:func:`relpos.pack`); no ``key_mask`` then.

        Returns:
            ``(B, L, C)`` per-token logits, or ``(B, C)`` with ``pool`` (C = ``num_classes`` or
            ``vocab_size``); packed: ``(T, C)``, or ``(N, C)`` with ``pool`` (an empty
            sequence pools to zeros).

        Raises:
            TypeError, ValueError: on bad ids, masks, ``pool`` or a cache.
        """
        if cache is not None:
            raise ValueError(
                "RelativeTransformerEncoderModel does not take a cache (it attends over the "
                "whole sequence); incremental decoding is RelativeTransformerLM's"
            )
        if pool not in (None, "mean", "first"):
            raise ValueError(f"pool must be None, 'mean' or 'first', got {pool!r}")
        if cu_seqlens is not None:
            if key_mask is not None:
                raise ValueError("a packed call (cu_seqlens=...) takes no key_mask")
            ids, cu = self.check_packed(ids, cu_seqlens)
            h = self.hidden_packed(ids, cu, is_causal=self.config.causal)  # (T, E)
            if pool is not None:
                lengths = (cu[1:] - cu[:-1]).to(h.device)
                if pool == "mean":
                    seq = torch.repeat_interleave(torch.arange(len(lengths), device=h.device),
                                                  lengths)
                    sums = h.new_zeros(len(lengths), h.shape[1]).index_add_(0, seq, h)
                    h = sums / lengths.clamp_min(1).unsqueeze(1).to(h.dtype)  # (N, E)
                else:
                    first = cu[:-1].clamp_max(max(h.shape[0] - 1, 0)).to(h.device)
                    h = torch.where((lengths > 0).unsqueeze(1), h[first], 0.0) if h.shape[0] \
                        else h.new_zeros(len(lengths), h.shape[1])
            return self.logits(h)
        ids = self.check_ids(ids, key_mask)
        h = self.hidden(ids, key_mask, None, is_causal=self.config.causal)  # (B, L, E)
        if pool == "mean":
            if key_mask is None:
                h = h.mean(dim=1)  # (B, E)
            else:
                w = key_mask.to(h.dtype).unsqueeze(-1)  # (B, L, 1)
                h = (h * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)  # (B, E)
        elif pool == "first":
            h = h[:, 0]  # (B, E)
        return self.logits(h)


def build_model(config: ModelConfig) -> nn.Module:
    """:class:`RelativeTransformerLM` if ``config.causal`` else
    :class:`RelativeTransformerEncoderModel`.

    The config was validated when it was made (:meth:`ModelConfig.validate` runs in its
    ``__post_init__``); call ``config.validate()`` after changing a field by hand.

    Raises:
        TypeError: if ``config`` is not a :class:`ModelConfig`.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a relpos.models.ModelConfig, got {type(config).__name__}")
    if config.causal:
        return RelativeTransformerLM(config)
    return RelativeTransformerEncoderModel(config)
