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

from typing import Literal, get_args

__all__ = ["BACKENDS", "Implementation"]

Implementation = Literal["triton", "native", "decode", "fused", "bucketed", "reference"]
"""Backend names, in the order auto-selection tries them: the first that serves a call wins."""

BACKENDS: tuple[str, ...] = get_args(Implementation)
