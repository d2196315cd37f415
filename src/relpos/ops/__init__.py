"""Attention backends. Every backend module exposes the same two functions of one
:class:`~relpos.ops.call.AttentionCall`:

``attention(call) -> Tensor`` (``(B, H, L, Dv)``) and ``unsupported_reason(call) -> str | None``
(None when the backend can serve the call, else one reason). A backend may also define
``auto_reason(call)``: why auto-selection should pass it by although it could serve the call
(speed); without one, auto-selection uses ``unsupported_reason``.

The call arrives validated by :func:`relpos.functional.validate_call`:

- ``query (B, H, L, D)``, ``key (B, H, S, D)``, ``value (B, H, S, Dv)``;
- ``rel_keys`` ``None`` or ``(Hr, R, D)`` and ``rel_values`` ``None`` or ``(Hr, R, Dv)``, with
  ``Hr`` in ``{1, H}`` and ``R = 2K + 1``;
- ``attn_mask`` ``None`` or a bool (True = may attend) / float (added) tensor broadcastable to
  ``(B, H, L, S)``; ``key_mask`` ``None`` or ``(B, S)`` bool (True = real token);
- ``query_start`` the resolved position of query 0, ``scale`` a float.

Rows with no visible key return zeros (and zero gradients), never NaN.
"""

from __future__ import annotations

from typing import Literal, cast, get_args

from relpos import _deprecated

__all__ = [
    "BACKENDS",
    "RENAMED_BACKENDS",
    "BackendReasons",
    "Implementation",
    "check_implementation",
]

Implementation = Literal["triton", "native", "decode", "flash_regions", "bucketed", "reference"]
"""Backend names, in the order auto-selection tries them: the first that serves a call wins."""

BACKENDS: tuple[str, ...] = get_args(Implementation)

RENAMED_BACKENDS: dict[str, str] = {"fused": "flash_regions"}
"""Old backend names (old -> new), still accepted with a DeprecationWarning and served by the
same backend; they go in 0.2. ``"fused"`` named a decomposition over torch's flash kernels, not
a fused kernel (the native and triton backends are those)."""


def _warn_renamed(old: str, what: str) -> str:
    new = RENAMED_BACKENDS[old]
    _deprecated.warn(f"{what}{old!r} is deprecated; use {what}{new!r} (the same backend, renamed)")
    return new


def check_implementation(value: object) -> Implementation | None:
    """The backend that ``implementation=value`` names, or None (auto-selection). An old name
    (:data:`RENAMED_BACKENDS`) warns and gives the new one.

    Raises:
        ValueError: if ``value`` names no backend.
    """
    if isinstance(value, str) and value in RENAMED_BACKENDS:
        return cast(Implementation, _warn_renamed(value, "implementation="))
    if value is not None and value not in BACKENDS:
        raise ValueError(
            f"unknown implementation {value!r}; allowed: None (auto), "
            + ", ".join(repr(b) for b in reversed(BACKENDS))
        )  # the definition first
    return cast(Implementation | None, value)


class BackendReasons(dict[str, "str | None"]):
    """Each backend, in :data:`BACKENDS` order, with why a call would not run it (None: it
    would). An old name (:data:`RENAMED_BACKENDS`) still reads its backend's reason, with a
    DeprecationWarning; only the new names are listed."""

    def __missing__(self, key: str) -> str | None:
        if isinstance(key, str) and key in RENAMED_BACKENDS:
            return self[_warn_renamed(key, "the backend name ")]
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        return self[key] if key in self or key in RENAMED_BACKENDS else default
