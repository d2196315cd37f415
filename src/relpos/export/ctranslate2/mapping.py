"""The mapping of a :class:`~relpos.models.RelativeTransformerLM` onto CTranslate2's
Transformer decoder spec, weight by weight (the table and the details that keep the two
engines equal are in :mod:`relpos.export.ctranslate2`), what cannot be mapped exactly, the
vocabulary, and :func:`to_ctranslate2`, which writes the model directory atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos._io import atomic_directory
from relpos._version import __version__
from relpos.export.ctranslate2.format import (
    FORMAT,
    FORMAT_VERSION,
    METADATA,
    VOCABULARY_FILE,
    CTranslate2ExportError,
    require_ctranslate2,
)
from relpos.models import RelativeTransformerEncoderModel, RelativeTransformerLM
from relpos.modules import RelativeTransformerEncoderLayer

__all__ = ["QUANTIZATIONS", "checkpoint_vocabulary", "to_ctranslate2"]

#: Weight types CTranslate2's converter accepts (``quantization=``; None = as the model).
QUANTIZATIONS = (
    "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
    "float32",
)


# ---------------------------------------------------------------------------------------------
# what can be exported


def _refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be written as a CTranslate2 decoder, or None."""
    name = type(model).__name__
    if isinstance(model, RelativeTransformerEncoderModel):
        return (
            f"got a {name}; allowed: a RelativeTransformerLM (CTranslate2's encoder model "
            "returns hidden states and a BERT pooler, it has no per-token or tied output head)"
        )
    if not isinstance(model, RelativeTransformerLM):
        return f"got a {name}; allowed: a relpos.models.RelativeTransformerLM"
    cfg = model.config
    if cfg.num_classes is not None:
        return (
            f"got a model with num_classes={cfg.num_classes}; allowed: num_classes=None (the "
            "output head tied to the token embedding, a language model)"
        )
    if cfg.positions == "sinusoidal":
        return (
            "got positions='sinusoidal'; allowed: 'relative', 'learned' or 'none' "
            "(CTranslate2's built-in sinusoid has other frequencies, a [sin, cos] layout "
            "and starts at position 1)"
        )
    if cfg.uses_relative:
        if not cfg.share_heads:
            return (
                "got share_heads=False (one relative table per head); allowed: "
                "share_heads=True (CTranslate2's tables are shared by all heads)"
            )
        left, right = _window(cfg.max_distance)
        if left != right:
            return (
                f"got the window max_distance=({left}, {right}); allowed: a symmetric clip "
                "distance K (left == right: CTranslate2's decoder tables are symmetric)"
            )
    return _layer_refusal(model)


def _window(max_distance: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(max_distance, tuple):
        return max_distance
    return max_distance, max_distance


def _layer_refusal(model: RelativeTransformerLM) -> str | None:
    """The blocks must be the models' own: pre-norm, erf GELU, one norm epsilon."""
    eps = model.norm.eps
    for i, layer in enumerate(model.layers):
        where = f"layer {i}"
        if not isinstance(layer, RelativeTransformerEncoderLayer):
            return f"{where} is a {type(layer).__name__}; allowed: RelativeTransformerEncoderLayer"
        if not layer.norm_first:
            return f"{where} is post-norm (norm_first=False); allowed: norm_first=True"
        if layer.activation is not F.gelu:
            return (
                f"{where} has the activation {layer.activation!r}; allowed: 'gelu' (exact, "
                "erf; CTranslate2's Activation.GELU)"
            )
        attn = layer.self_attn
        if attn.in_proj_weight is None or attn.bias_k is not None or attn.add_zero_attn:
            return (
                f"{where}: self-attention with separate q/k/v weights, bias_k or "
                "add_zero_attn; allowed: one in_proj_weight (kdim == vdim == embed_dim)"
            )
        for norm in (layer.norm1, layer.norm2):
            if norm.eps != eps:
                return (
                    f"{where} has layer_norm_eps={norm.eps}, the final norm {eps}; allowed: "
                    "one epsilon (CTranslate2 has one)"
                )
    return None


def check_model(model: object) -> RelativeTransformerLM:
    """``model`` as a :class:`~relpos.models.RelativeTransformerLM` CTranslate2 holds exactly.

    Raises:
        TypeError: if it is not a torch module.
        CTranslate2ExportError: the reason it cannot be exported, in one line.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a relpos.models.RelativeTransformerLM, got {type(model).__name__}"
        )
    reason = _refusal(model)
    if reason is not None:
        raise CTranslate2ExportError(f"cannot export to CTranslate2: {reason}")
    assert isinstance(model, RelativeTransformerLM)
    return model


# ---------------------------------------------------------------------------------------------
# vocabulary


def _vocabulary(vocabulary: str | Sequence[str] | None, size: int) -> tuple[list[str], str]:
    """(V tokens, kind) from the ``vocabulary`` argument."""
    if vocabulary is None:
        return [str(i) for i in range(size)], "ids"
    if isinstance(vocabulary, str):
        tokens, kind = list(vocabulary), "chars"
    elif isinstance(vocabulary, Sequence) and all(isinstance(t, str) for t in vocabulary):
        tokens, kind = list(vocabulary), "tokens"
    else:
        raise TypeError(
            f"vocabulary must be None, a str of V characters or a sequence of V str tokens, "
            f"got {type(vocabulary).__name__}"
        )
    if len(tokens) != size:
        raise CTranslate2ExportError(
            f"the vocabulary has {len(tokens)} tokens, the model's vocab_size is {size}; "
            "allowed: exactly vocab_size tokens"
        )
    if any(t == "" for t in tokens):
        raise CTranslate2ExportError("the vocabulary has an empty token; allowed: non-empty str")
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))  # type: ignore[func-returns-value]
        raise CTranslate2ExportError(
            f"the vocabulary has the token {dup!r} twice; allowed: distinct tokens "
            "(CTranslate2 looks tokens up by their text)"
        )
    return tokens, kind


def checkpoint_vocabulary(directory: str | os.PathLike[str]) -> str | None:
    """The characters of a ``relpos train --text`` checkpoint (token ``i`` = ``chars[i]``),
    or None for a checkpoint of another task.

    Args:
        directory: a checkpoint directory (the one holding ``latest.json``).

    Raises:
        relpos.training.checkpoint.CheckpointError: if it holds no readable checkpoint.
    """
    from relpos.training.checkpoint import text_vocabulary

    return text_vocabulary(directory)


# ---------------------------------------------------------------------------------------------
# export


def _array(t: Tensor) -> Any:
    """A float32 numpy copy: CTranslate2 quantizes the arrays it is given in place."""
    return t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous().numpy()


def _set_linear(spec: Any, linear: nn.Linear) -> None:
    spec.weight = _array(linear.weight)
    if linear.bias is not None:
        spec.bias = _array(linear.bias)


def _set_norm(spec: Any, norm: nn.LayerNorm) -> None:
    E = norm.normalized_shape[0]
    spec.gamma = _array(norm.weight) if norm.weight is not None else _array(torch.ones(E))
    spec.beta = _array(norm.bias) if norm.bias is not None else _array(torch.zeros(E))


def _spec(ct2: Any, model: RelativeTransformerLM, tokens: list[str]) -> Any:
    """The filled ``TransformerDecoderModelSpec`` of ``model``."""
    cfg = model.config
    learned = cfg.positions == "learned"
    spec = ct2.specs.TransformerDecoderModelSpec.from_config(
        cfg.num_layers, cfg.num_heads, pre_norm=True, activation=ct2.specs.Activation.GELU,
        with_relative_position=not learned,
    )
    dec = spec.decoder
    dec.scale_embeddings = True  # x sqrt(E), E read from the embedding width
    dec.embeddings.weight = _array(model.embed.weight)
    if learned:
        assert model.pos_embed is not None
        dec.position_encodings.encodings = _array(model.pos_embed.weight)
    D = cfg.d_model // cfg.num_heads
    K = _window(cfg.max_distance)[0] if cfg.uses_relative else 0
    layers = [layer for layer in model.layers if isinstance(layer, RelativeTransformerEncoderLayer)]
    assert len(layers) == len(model.layers)  # _layer_refusal checked them
    for layer_spec, layer in zip(dec.layer, layers, strict=True):
        attn, sa = layer.self_attn, layer_spec.self_attention
        _set_norm(sa.layer_norm, layer.norm1)
        assert attn.in_proj_weight is not None
        sa.linear[0].weight = _array(attn.in_proj_weight)  # (3E, E): [Wq; Wk; Wv]
        if attn.in_proj_bias is not None:
            sa.linear[0].bias = _array(attn.in_proj_bias)
        _set_linear(sa.linear[1], attn.out_proj)
        if not learned:
            # CT2 takes K from the keys table and adds its own positions without one.
            zeros = _array(torch.zeros(2 * K + 1, D))  # (R, D)
            keys = attn.rel_keys if cfg.uses_relative else None
            values = attn.rel_values if cfg.uses_relative else None
            sa.relative_position_keys = zeros if keys is None else _array(keys)
            if values is None:
                delattr(sa, "relative_position_values")  # no value term
            else:
                sa.relative_position_values = _array(values)
        _set_norm(layer_spec.ffn.layer_norm, layer.norm2)
        _set_linear(layer_spec.ffn.linear_0, layer.linear1)
        _set_linear(layer_spec.ffn.linear_1, layer.linear2)
    _set_norm(dec.layer_norm, model.norm)
    dec.projection.weight = _array(model.embed.weight)  # the tied head: (V, E)
    spec.config.layer_norm_epsilon = float(model.norm.eps)
    # from_config sets this True when num_heads_kv is not given (None != num_heads); the
    # model has plain multi-head attention (CT2 reads the flag only to split tensor parallel).
    spec.config.multi_query_attention = False
    spec.config.unk_token = spec.config.bos_token = spec.config.eos_token = tokens[0]
    spec.register_vocabulary(tokens)
    return spec


def _metadata(
    ct2: Any, model: RelativeTransformerLM, tokens: list[str], kind: str,
    quantization: str | None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "relpos_version": __version__,
        "ctranslate2_version": getattr(ct2, "__version__", None),
        "class": "RelativeTransformerLM",
        "config": model.config.to_dict(),
        "quantization": quantization,
        "vocabulary": {"kind": kind, "size": len(tokens), "file": VOCABULARY_FILE},
        # CT2 needs these three; relpos has none, so all are token 0 (V stays V).
        "special_tokens": {"unk": tokens[0], "bos": tokens[0], "eos": tokens[0]},
        # generate_batch(..., end_token=[]) never stops early on the stand-in eos.
        "end_token": [],
    }




def to_ctranslate2(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    quantization: str | None = None,
    vocabulary: str | Sequence[str] | None = None,
    force: bool = False,
) -> Path:
    """Write ``model`` as a CTranslate2 model directory (for ``ctranslate2.Generator``),
    atomically.

    The directory holds CTranslate2's ``model.bin``, ``config.json`` and ``vocabulary.json``
    plus ``relpos_ct2.json`` (see :mod:`relpos.export.ctranslate2`). It is written to a temporary
    directory beside ``path`` and renamed into place; an existing ``path`` is replaced only
    with ``force=True`` (and only once the new one is complete).

    Args:
        model: a :class:`relpos.models.RelativeTransformerLM` (relative positions with shared
            tables and a symmetric K, keys and/or values; or learned / no absolute positions).
        path: the directory to write.
        quantization: weight type, one of :data:`QUANTIZATIONS` (``"int8"``, ``"int16"``,
            ``"float16"``, ``"bfloat16"``, ...); None = float32 weights.
        vocabulary: the V tokens: a str of V characters (a ``relpos train --text`` model,
            :func:`checkpoint_vocabulary`), a sequence of V distinct str, or None (token
            ``i`` is ``str(i)``).
        force: replace an existing directory at ``path``.

    Returns:
        The directory written.

    Raises:
        CTranslate2ExportError: a model CTranslate2 cannot hold exactly (the reason in one
            line), a bad ``quantization`` or ``vocabulary``.
        CTranslate2MissingError: ``ctranslate2`` is not installed.
        FileExistsError: ``path`` exists (a file, or a directory without ``force``).
        FileNotFoundError: the parent directory of ``path`` does not exist.

    Example:
        >>> import tempfile
        >>> from relpos.models import ModelConfig
        >>> model = RelativeTransformerLM(ModelConfig(vocab_size=50, max_distance=4))
        >>> out = to_ctranslate2(model, Path(tempfile.mkdtemp()) / "lm-ct2")
        >>> sorted(p.name for p in out.iterdir())
        ['config.json', 'model.bin', 'relpos_ct2.json', 'vocabulary.json']
    """
    lm = check_model(model)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise CTranslate2ExportError(
            f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, "
            f"got {quantization!r}"
        )
    tokens, kind = _vocabulary(vocabulary, lm.config.vocab_size)
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{str(target)!r} is a file; allowed: a directory to write")
    if target.exists() and not force:
        raise FileExistsError(
            f"{str(target)!r} exists; allowed: a new path, or force=True to replace it"
        )
    if not target.parent.is_dir():
        raise FileNotFoundError(f"output directory {str(target.parent)!r} does not exist")
    ct2 = require_ctranslate2()
    spec = _spec(ct2, lm, tokens)
    spec.validate()
    spec.optimize(quantization=quantization)
    with atomic_directory(target, replace=force) as tmp:
        spec.save(str(tmp))
        meta = _metadata(ct2, lm, tokens, kind, quantization)
        (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return target
