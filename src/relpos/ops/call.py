"""The validated call every backend receives, and why a backend passes a call by.

:func:`relpos.functional.validate_call` checks the user's arguments once, at the public
boundary, and returns an :class:`AttentionCall`; backends read it and never re-validate.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance (``max_distance``), R = left + right + 1 table rows (2K + 1), Hr table heads
(1 or H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relpos._deprecated import module_getattr, moved

__all__ = [
    "AttentionCall", "Reason", "ensure_served", "needs_backward", "no_dropout_or_dense_mask",
]


@dataclass(frozen=True)
class Reason:
    """Why a backend passes a call by: ``template.format(**values)``, formatted only when read.

    Backends are asked on every call; under ``torch.compile`` formatting a symbolic length
    into a string would specialize the compiled graph to that length, so the message waits
    until someone reads it (``str(reason)``, an error message, ``"text" in reason``).
    """

    template: str
    values: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, template: str, **values: object) -> Reason:
        return cls(template, tuple(values.items()))

    def __str__(self) -> str:
        return self.template.format(**dict(self.values))

    def __contains__(self, text: str) -> bool:
        return text in str(self)


@dataclass(frozen=True)
class AttentionCall:
    """One validated call of :func:`relpos.relative_attention`.

    Attributes:
        query: ``(B, H, L, D)``.
        key: ``(B, H, S, D)``.
        value: ``(B, H, S, Dv)``.
        left, right: the clip window: offsets ``j - p_i`` are clipped to ``[-left, right]``
            (``left == right == K`` for a clip distance K); row ``r + left`` holds offset ``r``.
        rel_keys: ``(Hr, R, D)`` or None (the keys term is off).
        rel_values: ``(Hr, R, Dv)`` or None (the values term is off).
        attn_mask: None, or a bool (True = may attend) / float (added) tensor broadcastable
            to ``(B, H, L, S)``.
        key_mask: None or ``(B, S)`` bool, True = real token.
        is_causal: key ``j`` is visible to query ``i`` iff ``j <= query_start + i``.
        dropout_p: in ``[0, 1)``.
        scale: multiplies the content and the relative key term.
        query_start: position of query 0 (bottom-right alignment resolved).
        implementation: the backend asked for by name, or None for auto-selection.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    left: int
    right: int
    rel_keys: Tensor | None
    rel_values: Tensor | None
    attn_mask: Tensor | None
    key_mask: Tensor | None
    is_causal: bool
    dropout_p: float
    scale: float
    query_start: int
    implementation: str | None = None

    @property
    def dims(self) -> tuple[int, int, int, int, int, int]:
        """``(B, H, L, S, D, Dv)``."""
        B, H, L, D = self.query.shape
        return B, H, L, self.key.shape[2], D, self.value.shape[3]

    @property
    def max_distance(self) -> int | tuple[int, int]:
        """``K`` for a symmetric window, else ``(left, right)`` (as the user may write it)."""
        return self.left if self.left == self.right else (self.left, self.right)

    @property
    def table_rows(self) -> int:
        """R = left + right + 1."""
        return self.left + self.right + 1

    @property
    def query_len(self) -> int:
        return self.query.shape[2]

    @property
    def key_len(self) -> int:
        return self.key.shape[2]

    @property
    def has_relative_terms(self) -> bool:
        """Whether a keys or a values table takes part."""
        return self.rel_keys is not None or self.rel_values is not None

    @property
    def is_cache_step(self) -> bool:
        """Fewer queries than keys, aligned to the end of the keys (a KV-cache step)."""
        return self.query_len < self.key_len and self.query_start == self.key_len - self.query_len


def needs_backward(call: AttentionCall) -> bool:
    """Whether autograd will differentiate the call: grad mode is on and an input requires
    grad (auto-selection weighs the backward pass then)."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (call.query, call.key, call.value, call.rel_keys, call.rel_values)
    )


def ensure_served(backend: str, reason: Reason | str | None) -> None:
    """Raise the error of a backend asked to run a call it cannot serve (``reason`` is its
    ``unsupported_reason``; None: it serves the call, nothing is raised)."""
    if reason is not None:
        raise RuntimeError(f"the {backend} backend cannot serve this call: {reason}")


def no_dropout_or_dense_mask(call: AttentionCall, backend: str) -> Reason | str | None:
    """Why a backend that has no attention dropout and reads padding only as a ``(B, S)``
    ``key_mask`` (flash_regions, triton) cannot serve the call on those grounds, or None."""
    if call.dropout_p > 0.0:
        return (f"dropout_p={call.dropout_p} > 0: the {backend} backend has no attention dropout "
                "(the bucketed backend has)")
    if call.attn_mask is not None:
        return Reason.of("a dense attn_mask of shape {shape} is not supported by the {backend} "
                         "backend; use key_mask (B, S) for padding and is_causal",
                         shape=tuple(call.attn_mask.shape), backend=backend)
    return None


# Moved in 0.1 (the numerics and the custom-op scaffolding have homes of their own).
__getattr__ = module_getattr(__name__, {
    "accumulation_dtype": moved("relpos.ops._numerics.accumulation_dtype"),
    "exp_": moved("relpos.ops._numerics.exp_"),
    "empty_gradients": moved("relpos.ops._custom_op.empty_gradients"),
})
