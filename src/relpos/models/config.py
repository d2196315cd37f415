"""``ModelConfig``: the validated, serializable description of a relpos model."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

__all__ = ["POSITIONS", "ModelConfig"]

POSITIONS = ("relative", "learned", "sinusoidal", "none")


def _positive_int(name: str, value: object, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        allowed = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise TypeError(f"ModelConfig.{name} must be {allowed}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"ModelConfig.{name} must be >= {minimum}, got {value}")


def _window(value: object) -> int | tuple[int, int]:
    """``ModelConfig.max_distance``: an int K >= 0, or a pair (left, right) of them."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(
                f"ModelConfig.max_distance must be an int K >= 0 or a pair (left, right), got "
                f"{len(value)} values: {tuple(value)!r}"
            )
        _positive_int("max_distance[0] (left)", value[0], minimum=0)
        _positive_int("max_distance[1] (right)", value[1], minimum=0)
        return int(value[0]), int(value[1])
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"ModelConfig.max_distance must be an int >= 0 or a pair (left, right) of them, "
            f"got {value!r}"
        )
    _positive_int("max_distance", value, minimum=0)
    return int(value)


@dataclass
class ModelConfig:
    """Hyperparameters of :class:`relpos.models.RelativeTransformerLM` and
    :class:`relpos.models.RelativeTransformerEncoderModel` (built by
    :func:`relpos.models.build_model`).

    Every field is validated once, when the config is made (``__post_init__`` runs
    :meth:`validate`); the models and :func:`~relpos.models.build_model` take a
    ``ModelConfig`` as valid. After changing a field by hand, call :meth:`validate` again.

    Attributes:
        vocab_size: V, number of token ids.
        d_model: E, the model dimension.
        num_layers: number of transformer blocks.
        num_heads: H; must divide ``d_model``.
        dim_feedforward: hidden size of the MLP; None = ``4 * d_model``.
        max_distance: K, the clip distance of the relative positions, or a window
            ``(left, right)`` (offsets clipped to ``[-left, +right]``; a list, as JSON gives it
            back, becomes a tuple).
        relative_keys: learn the relative key term (``positions="relative"`` only).
        relative_values: learn the relative value term (``positions="relative"`` only).
        share_heads: one relative table for all heads (Shaw's choice) or one per head.
        positions: ``"relative"`` (Shaw et al., no absolute positions), or an absolute baseline
            without relative terms: ``"learned"`` (an embedding of ``max_length`` rows),
            ``"sinusoidal"`` (Vaswani et al.) or ``"none"`` (no position information; with
            ``causal`` the mask still orders tokens).
        max_length: longest sequence for ``positions="learned"`` (longer inputs raise).
        dropout: dropout rate in ``[0, 1)`` (embeddings, attention, residual branches).
        causal: True = decoder-only language model, False = bidirectional encoder.
        num_classes: None = output head tied to the token embedding (``vocab_size`` logits);
            an int = a separate per-token head with ``num_classes`` outputs.

    Example:
        >>> cfg = ModelConfig(vocab_size=100, max_distance=8)
        >>> ModelConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    vocab_size: int
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    dim_feedforward: int | None = None
    max_distance: int | tuple[int, int] = 16
    relative_keys: bool = True
    relative_values: bool = True
    share_heads: bool = True
    positions: str = "relative"
    max_length: int = 1024
    dropout: float = 0.0
    causal: bool = True
    num_classes: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field.

        Raises:
            TypeError: a field has the wrong type.
            ValueError: a field has a value outside what is allowed.
        """
        _positive_int("vocab_size", self.vocab_size)
        _positive_int("d_model", self.d_model)
        _positive_int("num_layers", self.num_layers)
        _positive_int("num_heads", self.num_heads)
        _positive_int("dim_feedforward", self.dim_feedforward, allow_none=True)
        self.max_distance = _window(self.max_distance)
        _positive_int("max_length", self.max_length)
        _positive_int("num_classes", self.num_classes, allow_none=True)
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} is not divisible by "
                f"num_heads={self.num_heads}; allowed: num_heads dividing d_model"
            )
        for name in ("relative_keys", "relative_values", "share_heads", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.positions not in POSITIONS:
            raise ValueError(
                f"ModelConfig.positions must be one of {', '.join(map(repr, POSITIONS))}, "
                f"got {self.positions!r}"
            )
        if self.positions == "relative" and not (self.relative_keys or self.relative_values):
            raise ValueError(
                "ModelConfig.positions='relative' needs relative_keys or relative_values; "
                "for a model without position information use positions='none'"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real):
            raise TypeError(f"ModelConfig.dropout must be a float in [0, 1), got {self.dropout!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ffn_dim(self) -> int:
        """The MLP hidden size: ``dim_feedforward`` or ``4 * d_model``."""
        return self.dim_feedforward if self.dim_feedforward is not None else 4 * self.d_model

    @property
    def uses_relative(self) -> bool:
        """Whether the attention layers have relative terms (``positions == "relative"``)."""
        return self.positions == "relative"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable dict of every field (``from_dict`` inverts it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> ModelConfig:
        """Build a validated config from :meth:`to_dict`'s output.

        Raises:
            TypeError: ``d`` is not a dict or a field has the wrong type.
            ValueError: unknown or missing keys, or a value outside what is allowed.
        """
        if not isinstance(d, dict):
            raise TypeError(f"ModelConfig.from_dict needs a dict, got {type(d).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(fields), key=str)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig keys {unknown}; allowed: {', '.join(fields)}"
            )
        if "vocab_size" not in d:
            raise ValueError("ModelConfig.from_dict: missing required key 'vocab_size'")
        return cls(**d)
