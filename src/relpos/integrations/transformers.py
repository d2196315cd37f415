"""Hugging Face ``transformers`` models through relpos (extra ``relpos[transformers]``).

:func:`patch` routes the Shaw-style self-attention of a ``transformers`` model through
:func:`relpos.relative_attention`, in place. Supported: the ``relative_key`` self-attention of
w2v-BERT 2.0 (``Wav2Vec2BertModel`` and every model built on it, e.g.
``Wav2Vec2BertForCTC``) and of SeamlessM4T v2's speech encoder: the keys term only, one table
``distance_embedding`` of ``left + right + 1`` rows shared by all heads, offsets ``j - i``
clipped to ``[-left_max_position_embeddings, +right_max_position_embeddings]`` (``(64, 8)`` in
the released checkpoints), both score terms scaled by ``head_size ** -0.5``. That is exactly
relpos's math with ``max_distance=(left, right)``, ``rel_keys=distance_embedding.weight``.

``transformers`` builds an ``(L, S, head_size)`` embedding and a dense ``(B, H, L, S)`` bias in
every layer; relpos serves the same numbers with the flash_regions backend's O(n) memory.
Attention maps come back when asked for as ``transformers`` asks: by the call's
``output_attentions`` or, without it, by ``config.output_attentions``. Every ``transformers`` the
extra allows (5.x) is served: before 5.16 the attention modules have no ``scaling`` and the patch
uses theirs, ``head_size ** -0.5``.

Parameters, buffers, the config and the state dict are untouched (only each attention module's
``forward`` is replaced). ``torch.save`` / ``torch.load`` (``weights_only=False``) keep the
patch (the pickle names relpos's forward, so relpos must be installed where it is loaded).
``save_pretrained`` writes the stock checkpoint (the weights and config ``transformers``
writes, loadable without relpos) and ``from_pretrained`` builds a stock model: patch it again
after loading.

Example::

    model = Wav2Vec2BertModel.from_pretrained(...)
    relpos.integrations.transformers.patch(model)   # -> number of attention modules patched

Shape legend: B batch, L = S frames, H heads, D head size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from relpos.functional import relative_attention, relative_attention_with_weights
from relpos.integrations._patching import is_patched, route

__all__ = ["SUPPORTED", "is_patched", "patch"]

SUPPORTED: dict[str, str] = {
    "Wav2Vec2BertSelfAttention": "transformers.models.wav2vec2_bert.modeling_wav2vec2_bert",
    "SeamlessM4Tv2ConformerSelfAttention":
        "transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2",
}
"""Attention classes :func:`patch` serves, by name, with the module that defines them."""



def _supported_classes() -> tuple[type, ...]:
    import importlib

    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "relpos.integrations.transformers needs the transformers package: "
            "pip install 'relpos[transformers]'"
        ) from err
    classes = []
    for name, module in SUPPORTED.items():
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ModuleNotFoundError, AttributeError):  # not in this transformers version
            continue
    return tuple(classes)


def _key_mask(attention_mask: Tensor | None, B: int, L: int) -> tuple[Tensor | None, Tensor | None]:
    """``(key_mask, attn_mask)`` for relpos from the 4-D mask ``transformers`` hands a layer.

    A padding-only mask (every query row the same) becomes a ``(B, S)`` key mask (True = real
    frame), which the flash_regions backend serves in O(n) memory; anything else is passed on as a
    dense mask (bool True = may attend, or float added to the scores). Under
    ``torch.compile`` the values cannot be inspected without a data-dependent branch, so every
    mask is passed on dense (a float one with ``-inf`` where hidden): one graph, the same
    numbers, the bucketed backend's memory.
    """
    if attention_mask is None:
        return None, None
    mask = attention_mask
    if mask.dim() != 4:
        raise ValueError(
            f"expected the 4-D attention mask transformers builds, got shape {tuple(mask.shape)}"
        )
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if torch.compiler.is_compiling():
        # No branch on the mask's values (a graph break, or an error under fullgraph): the
        # general form, a float bias with -inf where hidden (the same as False in relpos).
        return None, visible if mask.dtype == torch.bool else mask.masked_fill(
            ~visible, float("-inf"))
    if mask.dtype != torch.bool and not bool(((mask == 0) | ~visible).all()):
        return None, mask  # a float bias, not just a mask: added to the scores as it is
    first = visible[:, 0, :1, :]  # (B, 1, S)
    if visible.shape[1] == 1 and bool((visible[:, 0] == first).all()):
        return first[:, 0].expand(B, visible.shape[-1]).contiguous(), None
    return None, visible


def _scale(module: Any) -> float:
    """The attention's scale: ``module.scaling`` (transformers 5.16 and later), or what earlier
    versions divide both score terms by, ``sqrt(head_size)``."""
    scaling = getattr(module, "scaling", None)
    return float(module.head_size**-0.5 if scaling is None else scaling)


def _wants_weights(module: Any, kwargs: dict[str, Any]) -> bool:
    """Whether this call returns the attention probabilities, as transformers decides it.

    Up to 5.x's output hooks, each layer passes ``output_attentions`` down (the call's value, or
    the config's); with them (``capture_outputs``), the call's ``output_attentions`` reaches the
    attention only when the caller passed it, and the hooks otherwise read
    ``config.output_attentions``: the same precedence here, the call's value first, then the
    config's.
    """
    if "output_attentions" in kwargs:
        return bool(kwargs["output_attentions"])
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


def _relpos_forward(
    self: Any,  # a supported transformers attention module
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    relative_position_embeddings: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The patched forward: the same projections, relpos's attention."""
    B, L, _ = hidden_states.shape
    H, D = self.num_heads, self.head_size

    def heads(x: Tensor) -> Tensor:
        return x.view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)

    q = heads(self.linear_q(hidden_states))
    k = heads(self.linear_k(hidden_states))
    v = heads(self.linear_v(hidden_states))
    key_mask, attn_mask = _key_mask(attention_mask, B, L)
    options: dict[str, Any] = dict(
        max_distance=(self.left_max_position_embeddings, self.right_max_position_embeddings),
        rel_keys=self.distance_embedding.weight.to(q.dtype), key_mask=key_mask,
        attn_mask=attn_mask, dropout_p=self.dropout.p if self.training else 0.0,
        scale=_scale(self),
    )
    weights: Tensor | None = None
    if _wants_weights(self, kwargs):
        out, weights = relative_attention_with_weights(q, k, v, **options)
    else:
        out = relative_attention(q, k, v, **options)
    out = out.transpose(1, 2).reshape(B, L, H * D)  # (B, L, E)
    return self.linear_out(out), weights


def _refusal(module: nn.Module) -> str | None:
    kind = getattr(module, "position_embeddings_type", None)
    if kind != "relative_key":
        return (f"{type(module).__name__} uses position_embeddings_type={kind!r}; relpos serves "
                "'relative_key' (Shaw-style clipped relative keys)")
    return None


def patch(model: nn.Module) -> int:
    """Route every supported self-attention of ``model`` through relpos, in place.

    Args:
        model: a ``transformers`` model (``nn.Module``) containing supported attention modules
            (see :data:`SUPPORTED`) with ``position_embeddings_type="relative_key"``.

    Returns:
        The number of attention modules patched (modules already patched count too).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
        ValueError: if the model has no supported attention, or one whose configuration relpos
            does not serve (for example ``position_embeddings_type="rotary"``); nothing is
            patched then.
        ModuleNotFoundError: without the ``transformers`` package.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"patch expects a transformers model (nn.Module), got {type(model).__name__}"
        )
    classes = _supported_classes()
    found = [m for m in model.modules() if isinstance(m, classes)]
    # Attention without positions (w2v-BERT's adapter layers) stays as it is.
    relative = [m for m in found if getattr(m, "position_embeddings_type", None) is not None]
    if not relative:
        raise ValueError(
            f"{type(model).__name__} has no attention relpos can serve (supported: "
            f"{', '.join(SUPPORTED)} with position_embeddings_type='relative_key')"
        )
    return route(model, relative, _refusal, _relpos_forward)
