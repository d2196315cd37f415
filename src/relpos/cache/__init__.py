"""Key/value cache for incremental decoding with relative attention.

Shape legend: B batch, H heads, t new tokens in one step, S cached keys (after the step),
D key head dim, Dv value head dim.

A step appends ``t >= 1`` new keys/values (one token, a prefill chunk or a speculative
block) and attends with the ``t`` new queries over all ``S = c + t`` keys, ``c`` being the
cache length before the step. Queries are aligned to the END of the keys (bottom-right,
the default of :func:`relpos.relative_attention`): query ``i`` of the step is at position
``c + i``. Decoding token by token, in chunks of any sizes or in one causal pass gives the
same outputs.

A :class:`KVCache` holds one :class:`LayerCache` per layer. Storage is preallocated
(``capacity``) and, if ``growable``, doubles when full, so memory stays at most twice the
cached length (linear in the length).

Example:
    >>> cache = KVCache(num_layers=1, capacity=8)
    >>> k = v = torch.randn(2, 4, 3, 16)          # (B, H, t, D)
    >>> keys, values, key_mask = cache[0].append(k, v)
    >>> keys.shape, cache.length
    (torch.Size([2, 4, 3, 16]), 3)

The package: ``layer`` (:class:`LayerCache`), ``kv`` (:class:`KVCache`), ``packed``
(:class:`PackedLayerCache`, :class:`PackedKVCache`), ``_common`` (what they share).
"""

from __future__ import annotations

import torch  # noqa: F401  (the example above reads as a session after ``import torch``)

from relpos.cache.kv import KVCache
from relpos.cache.layer import LayerCache
from relpos.cache.packed import PackedKVCache, PackedLayerCache

__all__ = ["KVCache", "LayerCache", "PackedKVCache", "PackedLayerCache"]
