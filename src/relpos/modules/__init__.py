"""``nn.Module`` wrappers: they own the parameters and call :mod:`relpos.functional`."""

from relpos.modules.attention import RelativeMultiheadAttention
from relpos.modules.transformer_layers import (
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)

__all__ = [
    "RelativeMultiheadAttention",
    "RelativeTransformerDecoderLayer",
    "RelativeTransformerEncoderLayer",
]
