"""relpos: exact clipped relative position attention (Shaw, Uszkoreit & Vaswani, 2018).

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
E model dim, K clip distance (``max_distance``), R = 2K + 1 table rows.
"""

from relpos import models
from relpos.cache import KVCache, LayerCache
from relpos.functional import (
    available_backends,
    relative_attention,
    relative_attention_with_weights,
    why_not_fused,
)
from relpos.modules import (
    RelativeMultiheadAttention,
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)
from relpos.positions import clip_relative_position, relative_position_index
from relpos.tables import load_state_dict_resized, resize_relative_table
from relpos.versioning import RelativeStateError

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "LayerCache",
    "RelativeMultiheadAttention",
    "RelativeStateError",
    "RelativeTransformerDecoderLayer",
    "RelativeTransformerEncoderLayer",
    "__version__",
    "available_backends",
    "clip_relative_position",
    "load_state_dict_resized",
    "models",
    "relative_attention",
    "relative_attention_with_weights",
    "relative_position_index",
    "resize_relative_table",
    "why_not_fused",
]
