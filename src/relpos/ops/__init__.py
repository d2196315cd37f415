"""Attention backends. Every backend module exposes the same two functions:

``attention(query, key, value, *, rel_keys, rel_values, max_distance, attn_mask, key_mask,
is_causal, dropout_p, scale, query_start) -> Tensor`` and ``unsupported_reason(...)`` with the
same arguments, returning ``None`` when the backend can serve the call, else one reason.

The inputs arrive validated by :func:`relpos.relative_attention`:

- ``query (B, H, L, D)``, ``key (B, H, S, D)``, ``value (B, H, S, Dv)``;
- ``rel_keys`` ``None`` or ``(Hr, R, D)`` and ``rel_values`` ``None`` or ``(Hr, R, Dv)``, with
  ``Hr`` in ``{1, H}`` and ``R = 2K + 1``;
- ``attn_mask`` ``None`` or a bool (True = may attend) / float (added) tensor broadcastable to
  ``(B, H, L, S)``; ``key_mask`` ``None`` or ``(B, S)`` bool (True = real token);
- ``query_start`` the resolved position of query 0, ``scale`` a float.

Rows with no visible key return zeros (and zero gradients), never NaN.
"""

from __future__ import annotations

BACKENDS = ("reference", "bucketed", "fused", "decode")
