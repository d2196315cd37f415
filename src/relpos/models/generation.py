"""What :meth:`RelativeTransformerLM.generate` and ``generate_packed`` share: their argument
checks, the sampling of a token from logits, and ``generate_packed``'s steps on the fast
decoder (:class:`relpos.models.decoding.StepDecoder`).

Shape legend: N prompts, B rows of the step cache, P the longest prompt, H heads, D head dim,
V vocabulary.

``generate_packed`` prefills every prompt in one packed pass (no padding), then moves the
packed cache into the left-padded layout ``generate`` decodes with (:func:`padded_from_packed`:
each prompt's keys end at the same column, a key mask hides the columns before a shorter
prompt; relative offsets stay right because queries align to the end of the keys, and models
with absolute positions get each row's own position). Its steps sample one ``(N, V)`` row per
prompt, in prompt order, as ``generate`` does for a batch of N (a finished prompt's row takes
its draws, its token is dropped), and drop finished prompts from the step cache only when that
halves the step's attention work (:func:`compacted`: the live rows, without the leading
columns that are padding in every one of them).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos._sysinfo import available_memory
from relpos.cache import KVCache, PackedKVCache
from relpos.models.decoding import StepDecoder

__all__ = ["check_generation_memory", "check_max_new_tokens", "check_sampling", "check_tokens",
           "compacted", "left_pad", "packed_steps", "padded_from_packed", "sample"]

Sampling = tuple[float, int | None, float | None, torch.Generator | None]

#: The fewest step calls left for which dropping finished rows from the step cache pays (the
#: copy costs a few steps' reading of the cache).
COMPACT_MIN_STEPS = 4


def left_pad(prompts: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """``(N, P)`` token ids of the prompts left-padded (with 0) to the longest, ``P``, and the
    key mask ``generate`` takes for them (True = real token; None when no prompt is padded).

    Example:
        >>> ids, mask = left_pad([torch.tensor([5, 6]), torch.tensor([7])])
        >>> ids.tolist(), mask.tolist()
        ([[5, 6], [0, 7]], [[True, True], [False, True]])
    """
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros(len(prompts), P, dtype=torch.bool, device=prompts[0].device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = p
        mask[i, P - len(p):] = True
    return ids, None if bool(mask.all()) else mask


def check_max_new_tokens(max_new_tokens: object) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return int(max_new_tokens)


def check_sampling(
    temperature: object, top_k: object, top_p: object, generator: object
) -> Sampling:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float >= 0, got {temperature!r}")
    temp = float(temperature)
    if not (math.isfinite(temp) and temp >= 0):
        raise ValueError(f"temperature must be a finite float >= 0, got {temperature}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be an int >= 1 or None, got {top_k!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
            raise TypeError(f"top_p must be a float in (0, 1] or None, got {top_p!r}")
        if not 0.0 < float(top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return (
        temp,
        None if top_k is None else int(top_k),
        None if top_p is None else float(top_p),
        generator,
    )


def check_tokens(name: str, value: object, vocab_size: int) -> tuple[int, ...]:
    """``eos_token_id``/``pad_token_id`` as a tuple of ids in ``[0, vocab_size)``."""
    if value is None:
        return ()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        tokens: tuple[object, ...] = (value,)
    elif isinstance(value, (list, tuple)) and value:
        tokens = tuple(value)
    else:
        raise TypeError(f"{name} must be an int token id (or a non-empty list of them), got "
                        f"{value!r}")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name} must hold int token ids, got {t!r}")
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"{name} {t} is outside [0, vocab_size={vocab_size})")
    return tuple(int(t) for t in tokens)  # type: ignore[call-overload]


def check_generation_memory(model: Any, batch: int, P: int, N: int) -> None:
    """Refuse a generation whose cache (allocated up front) does not fit in memory."""
    cfg = model.config
    weight = model.embed.weight
    item = weight.element_size()
    # keys and values per layer, plus the step decoder's copies with their table rows
    copies = 2 * (1 + int(cfg.uses_relative))
    need = cfg.num_layers * copies * batch * (P + N) * cfg.d_model * item
    free = available_memory(weight.device)
    if free is not None and need > free:
        raise ValueError(
            f"max_new_tokens={N}: a cache of {P} + {N} positions needs "
            f"{need / 2**30:.3g} GiB, more than the {free / 2**30:.3g} GiB of memory "
            "available; allowed: fewer new tokens"
        )


def sample(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """Next token ``(B,)`` from ``(B, V)`` logits. Every row takes ``V`` draws of
    ``generator`` in row order (``torch.multinomial``'s one-sample path), whatever its logits."""
    if temperature == 0.0 or top_k == 1:
        return logits.argmax(dim=-1)
    # In float64, with the top logit at 0: no overflow, and a temperature too small to tell
    # from 0 gives the top token all the probability (greedy), never inf / inf.
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = F.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = (cum - F.softmax(sorted_logits, dim=-1)) >= top_p
        drop[:, 0] = False  # also when top_p rounds to 0 against the probabilities
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def padded_from_packed(packed: PackedKVCache, lengths: list[int], capacity: int) -> KVCache:
    """A fixed-size :class:`relpos.KVCache` of ``capacity`` positions holding the prompts of a
    packed cache left-padded to the longest, ``P``: prompt ``s``'s keys and values in columns
    ``P - lengths[s] .. P - 1`` and a key mask False before them (no mask when every prompt
    has ``P`` tokens)."""
    N, P = len(lengths), max(lengths)
    cache = KVCache(packed.num_layers, capacity=capacity, growable=False)
    mask = None
    lead = [P - n for n in lengths]
    for lc, plc in zip(cache, packed, strict=True):
        storage = plc.storage
        assert storage is not None, "prefill first"
        keys, values = storage  # (H, N, C, D)
        if mask is None and max(lead):
            mask = torch.arange(P, device=keys.device)[None, :] >= torch.tensor(
                lead, device=keys.device)[:, None]  # (N, P)
        if mask is None:
            k, v = keys[:, :, :P].transpose(0, 1), values[:, :, :P].transpose(0, 1)
        else:
            k = keys.new_empty(N, keys.shape[0], P, keys.shape[3])
            v = values.new_empty(N, values.shape[0], P, values.shape[3])
            for s, n in enumerate(lengths):
                k[s, :, :lead[s]] = 0  # masked, but never uninitialized memory
                v[s, :, :lead[s]] = 0
                k[s, :, lead[s]:] = keys[:, s, :n]
                v[s, :, lead[s]:] = values[:, s, :n]
        lc.append(k, v, mask)
    return cache


def compacted(cache: KVCache, keep: list[int], skip: int, capacity: int) -> KVCache:
    """A fixed-size cache of ``capacity`` positions holding rows ``keep`` of ``cache``
    without its first ``skip`` columns (padding in every kept row)."""
    out = KVCache(cache.num_layers, capacity=capacity, growable=False)
    layers = list(cache)
    idx = torch.tensor(keep, device=layers[0].keys.device)  # type: ignore[union-attr]
    for new, lc in zip(out, layers, strict=True):
        assert lc.keys is not None and lc.values is not None
        mask = lc.key_mask
        if mask is not None:
            mask = mask[:, skip:].index_select(0, idx)
            mask = None if bool(mask.all()) else mask
        new.append(lc.keys[:, :, skip:].index_select(0, idx),
                   lc.values[:, :, skip:].index_select(0, idx), mask)
    return out


def packed_steps(
    step: StepDecoder, cache: KVCache, logits: Tensor, lengths: list[int], max_new_tokens: int,
    sampling: Sampling, stop: tuple[int, ...], absolute: bool,
) -> list[list[int]]:
    """``generate_packed``'s tokens: ``max_new_tokens >= 1`` samples from ``logits`` (the
    prompts' last logits ``(N, V)``) and steps of ``step`` over ``cache`` (the prompts
    left-padded, :func:`padded_from_packed`); each prompt's list ends at its first ``stop``
    token. ``absolute``: the model has absolute positions (each row gets its own)."""
    N = len(lengths)
    device = logits.device
    stop_ids = torch.tensor(stop, device=device) if stop else None
    P = max(lengths)
    rows = list(range(N))  # the prompt of each row of the step cache
    lead = [P - n for n in lengths]  # the padding columns before each row's prompt
    index: Tensor | None = None  # rows as a tensor once a prompt left the step cache
    positions = torch.tensor(lengths, device=device) if absolute else None  # (N,)
    finished = [False] * N
    out: list[Tensor] = []
    for n in range(max_new_tokens):
        token = sample(logits, *sampling)  # (N,): one row per prompt, as generate draws them
        out.append(token)
        if n + 1 == max_new_tokens:
            break
        if stop_ids is not None:
            finished = [f or h for f, h in zip(finished, torch.isin(token, stop_ids).tolist(),
                                               strict=True)]
            if all(finished):
                break
            live = [r for r, s in enumerate(rows) if not finished[s]]
            left = max_new_tokens - 1 - n  # step calls to come
            if len(live) < len(rows) and left >= COMPACT_MIN_STEPS:
                S = cache.length + 1
                skip = min(lead[r] for r in live)
                if len(live) * (S - skip) * 2 <= len(rows) * S:  # the attention work halves
                    cache = compacted(cache, live, skip, cache.length - skip + left)
                    rows, lead = [rows[r] for r in live], [lead[r] - skip for r in live]
                    index = torch.tensor(rows, device=device)
        feed = token if index is None else token[index]
        at = None if positions is None else positions if index is None else positions[index]
        new = step(feed, cache, at)  # (B, V)
        logits = new if index is None else logits.index_copy(0, index, new)
        if positions is not None:
            positions += 1
    tokens = torch.stack(out, dim=1).tolist()  # (N, n)
    for row in tokens:
        hit = next((i for i, t in enumerate(row) if t in stop), None)
        if hit is not None:
            del row[hit + 1:]
    return tokens
