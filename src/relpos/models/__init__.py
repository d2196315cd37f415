"""Reference models built from relpos layers: a decoder-only LM and a bidirectional encoder."""

from relpos.models.config import ModelConfig
from relpos.models.transformer import (
    RelativeTransformerEncoderModel,
    RelativeTransformerLM,
    build_model,
)

__all__ = [
    "ModelConfig",
    "RelativeTransformerEncoderModel",
    "RelativeTransformerLM",
    "build_model",
]
