"""Export relpos language models to CTranslate2 (extra ``relpos[ct2]``).

CTranslate2's Transformer decoder implements Shaw et al.'s clipped relative attention exactly
as relpos does: ``MultiHeadAttentionSpec`` tables ``relative_position_keys`` and
``relative_position_values`` of ``(2K + 1, D)`` rows shared by every head (K read from the
height of the keys table), row ``clip(j - (i + S - L), -K, K) + K`` for query ``i`` and key
``j`` (bottom-right alignment, as relpos), and one scale ``1 / sqrt(D)`` for ``q·k`` and
``q·aK`` alike. A :class:`relpos.models.RelativeTransformerLM` maps onto
``TransformerDecoderModelSpec.from_config(num_layers, num_heads, pre_norm=True,
activation=Activation.GELU, with_relative_position=True)``, weight by weight::

    relpos                            CTranslate2 (decoder/...)
    embed.weight (x sqrt(E))          embeddings/weight (scale_embeddings=True)
    layers[i].norm1                   layer_i/self_attention/layer_norm
    layers[i].self_attn.in_proj_*     layer_i/self_attention/linear_0 ([Wq; Wk; Wv])
    layers[i].self_attn.out_proj      layer_i/self_attention/linear_1
    layers[i].self_attn.rel_keys      layer_i/self_attention/relative_position_keys
    layers[i].self_attn.rel_values    layer_i/self_attention/relative_position_values
    layers[i].norm2                   layer_i/ffn/layer_norm
    layers[i].linear1, linear2        layer_i/ffn/linear_0, linear_1 (GELU between)
    norm                              layer_norm
    embed.weight (the tied head)      projection/weight
    pos_embed.weight (learned)        position_encodings/encodings

Details that keep the two engines equal:

- **GELU**: relpos uses the exact (erf) GELU, ``F.gelu``; CTranslate2's ``Activation.GELU``
  is the erf form too (``GELUTanh`` is the tanh approximation, not used).
- **Keys-only / values-only**: CTranslate2 reads K from the keys table, and without one it
  adds no relative term and switches on its own sinusoidal positions. A values-only model is
  therefore written with an all-zero keys table of ``2K + 1`` rows (``q·0 = 0``: exact); a
  keys-only model has no values table (CTranslate2 then adds no value term).
- **positions="none"**: one zero keys row (K = 0), so no position encoding is added.
- **positions="learned"**: ``position_encodings/encodings`` holds the ``max_length`` rows,
  added after the ``sqrt(E)`` scaling as in relpos; CTranslate2 refuses longer inputs, as
  relpos does.
- **Layer norm epsilon**: CTranslate2 has one, written to ``config.json``
  (``layer_norm_epsilon``).

**Vocabulary.** The model directory's ``vocabulary.json`` (a JSON list, so whitespace tokens
survive) holds exactly V tokens: token ``i`` is ``str(i)`` (``"0"``, ``"1"``, ...; kind
``"ids"``) unless a vocabulary is given, e.g. the characters of a ``relpos train --text``
run (kind ``"chars"``, see :func:`checkpoint_vocabulary`). CTranslate2 appends its
``unk_token`` when the vocabulary lacks it and stops generating at ``eos_token``; relpos has
no such tokens, so ``unk_token``, ``bos_token`` and ``eos_token`` are all set to token 0,
which keeps V unchanged. Generation must then be told not to stop on it: pass
``end_token=[]`` to ``Generator.generate_batch`` / ``generate_tokens`` (what
:func:`check_ctranslate2` does); an unknown string token is read as token 0 - give tokens
that are in the vocabulary.

Beside CTranslate2's files, ``relpos_ct2.json`` records the relpos configuration and the
vocabulary kind (:func:`read_metadata`).

Refused (:class:`CTranslate2ExportError`, one line): anything but a
:class:`~relpos.models.RelativeTransformerLM` (a ``RelativeTransformerEncoderModel``: CT2's
encoder model returns hidden states and a BERT pooler, it has no per-token or tied output
head), a ``num_classes`` head, per-head tables (``share_heads=False``: CT2's tables are
shared), a window ``max_distance=(left, right)`` with ``left != right`` (CT2's decoder tables
are symmetric), sinusoidal absolute positions (CT2's built-in sinusoid has other frequencies,
a concatenated ``[sin, cos]`` layout and starts at position 1), and layers that are not the
models' own (post-norm, another activation, differing norm epsilons).

Shape legend: B batch, L tokens, E model dim, H heads, D head dim, K clip distance,
R = 2K + 1 table rows, V vocabulary.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos._version import __version__
from relpos.models import ModelConfig, RelativeTransformerEncoderModel, RelativeTransformerLM
from relpos.modules import RelativeTransformerEncoderLayer

__all__ = [
    "METADATA",
    "QUANTIZATIONS",
    "CTranslate2Case",
    "CTranslate2Check",
    "CTranslate2ExportError",
    "CTranslate2MissingError",
    "check_ctranslate2",
    "checkpoint_vocabulary",
    "generate_new_tokens",
    "load_generator",
    "load_vocabulary",
    "read_metadata",
    "require_ctranslate2",
    "to_ctranslate2",
]

#: The file beside CTranslate2's that describes the relpos model.
METADATA = "relpos_ct2.json"
FORMAT = "relpos.ctranslate2"
FORMAT_VERSION = 1
#: Weight types CTranslate2's converter accepts (``quantization=``; None = as the model).
QUANTIZATIONS = (
    "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
    "float32",
)
_VOCABULARY_FILE = "vocabulary.json"
# Temporary directories beside the target: "." + name + "." + pid + "." + 8 chars + ".tmp".
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]+)\.[a-z0-9_]{8}\.tmp$")


class CTranslate2ExportError(ValueError):
    """A model (or an argument) that CTranslate2 cannot hold exactly; the message says what
    was received and what is allowed."""


class CTranslate2MissingError(CTranslate2ExportError, ImportError):
    """The ``ctranslate2`` package is not installed (``pip install 'relpos[ct2]'``)."""


def require_ctranslate2() -> Any:
    """The ``ctranslate2`` module.

    Raises:
        CTranslate2MissingError: (a ValueError and an ImportError) if it is not installed.
    """
    try:
        import ctranslate2
    except ImportError as err:
        raise CTranslate2MissingError(
            f"CTranslate2 export needs the 'ct2' extra: pip install 'relpos[ct2]' ({err})"
        ) from None
    return ctranslate2


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


def _check_model(model: object) -> RelativeTransformerLM:
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
        "vocabulary": {"kind": kind, "size": len(tokens), "file": _VOCABULARY_FILE},
        # CT2 needs these three; relpos has none, so all are token 0 (V stays V).
        "special_tokens": {"unk": tokens[0], "bos": tokens[0], "eos": tokens[0]},
        # generate_batch(..., end_token=[]) never stops early on the stand-in eos.
        "end_token": [],
    }


def _remove_stale(parent: Path, name: str) -> None:
    """Temporary directories that dead writers of ``parent / name`` left behind."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            match = _TEMPORARY.match(entry.name)
            if match is None or match["name"] != name or not entry.is_dir():
                continue
            pid = int(match["pid"])
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                shutil.rmtree(entry, ignore_errors=True)
            except OSError:
                continue


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
    plus ``relpos_ct2.json`` (see the module docstring). It is written to a temporary
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
        >>> model = RelativeTransformerLM(ModelConfig(vocab_size=50, max_distance=4))
        >>> out = to_ctranslate2(model, Path(tempfile.mkdtemp()) / "lm-ct2")
        >>> sorted(p.name for p in out.iterdir())
        ['config.json', 'model.bin', 'relpos_ct2.json', 'vocabulary.json']
    """
    lm = _check_model(model)
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp",
                                dir=target.parent))
    old: Path | None = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes the directory private (0700)
        spec.save(str(tmp))
        meta = _metadata(ct2, lm, tokens, kind, quantization)
        (tmp / METADATA).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        for file in tmp.iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        if target.exists():  # force: move the old one aside, then swap
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.",
                                        suffix=".tmp", dir=target.parent))
            os.rmdir(old)
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        if old is not None and not target.exists():
            os.replace(old, target)  # put the old one back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)
    _remove_stale(target.parent, target.name)
    return target


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# reading an exported directory


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``relpos_ct2.json`` of an exported directory (its ``config`` as a dict).

    Raises:
        FileNotFoundError: if ``path`` holds no ``relpos_ct2.json``.
        CTranslate2ExportError: if it is not one this relpos wrote.
    """
    file = Path(path) / METADATA
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a relpos CTranslate2 export: no {METADATA}"
        )
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise CTranslate2ExportError(f"damaged {str(file)!r}: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CTranslate2ExportError(f"{str(file)!r} is not a relpos CTranslate2 description")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CTranslate2ExportError(
            f"{str(file)!r} has format version {meta.get('format_version')!r}; this relpos "
            f"reads version {FORMAT_VERSION}"
        )
    return meta


def load_vocabulary(path: str | os.PathLike[str]) -> list[str]:
    """The V tokens of an exported directory (``vocabulary.json``; token ``i`` is id ``i``)."""
    file = Path(path) / _VOCABULARY_FILE
    try:
        tokens = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(path)!r} has no {_VOCABULARY_FILE}") from None
    except ValueError as err:
        raise CTranslate2ExportError(f"damaged {str(file)!r}: {err}") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise CTranslate2ExportError(f"{str(file)!r} is not a JSON list of str tokens")
    return tokens


def load_generator(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    compute_type: str = "default",
    intra_threads: int = 0,
    inter_threads: int = 1,
) -> Any:
    """A ``ctranslate2.Generator`` over an exported directory.

    Args:
        path: a directory written by :func:`to_ctranslate2`.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        compute_type: CTranslate2's compute type (``"default"`` = the stored weight type,
            or the nearest the device supports; ``"float32"``, ``"int8"``, ...).
        intra_threads: threads per generation (0 = CTranslate2's default).
        inter_threads: parallel generations.

    Raises:
        CTranslate2MissingError: ``ctranslate2`` is not installed.
        FileNotFoundError: ``path`` is not a relpos CTranslate2 export.
    """
    ct2 = require_ctranslate2()
    read_metadata(path)
    return ct2.Generator(
        str(path), device=device, compute_type=compute_type, intra_threads=int(intra_threads),
        inter_threads=int(inter_threads),
    )


def generate_new_tokens(
    generator: Any, start_tokens: Sequence[Sequence[str]], max_new_tokens: int,
    **options: Any,
) -> list[list[int]]:
    """``max_new_tokens`` new token ids per prompt from ``generator.generate_batch``.

    Calls ``generate_batch(start_tokens, include_prompt_in_result=False, end_token=[],
    sampling_topk=1, **options)`` (greedy unless ``options`` say otherwise; no stop token,
    see the module docstring) and returns only the new tokens. CTranslate2 forwards the
    prompts up to the shortest one's length minus one at once and forces the rest; when the
    shortest prompt has a single token nothing is forwarded at once and the result then
    starts with each prompt's tokens after its first, counted in ``max_length``. This
    helper asks for enough tokens and removes them, so every batch gives the same answer.

    Args:
        generator: a ``ctranslate2.Generator`` (:func:`load_generator`).
        start_tokens: B prompts of at least one token each (vocabulary strings).
        max_new_tokens: N >= 1.
        **options: more ``generate_batch`` options (not ``max_length`` or
            ``include_prompt_in_result``).

    Returns:
        B lists of N token ids (fewer if an ``end_token`` in ``options`` stopped one).
    """
    for name in ("max_length", "include_prompt_in_result"):
        if name in options:
            raise TypeError(f"generate_new_tokens sets {name} itself; leave it out")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
        max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    prompts = [list(p) for p in start_tokens]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("start_tokens needs at least one prompt, each of at least one token")
    lengths = [len(p) for p in prompts]
    # The shortest prompt has one token: each result starts with prompt[1:].
    echoed = [n - 1 for n in lengths] if min(lengths) == 1 else [0] * len(prompts)
    options.setdefault("end_token", [])
    options.setdefault("sampling_topk", 1)
    results = generator.generate_batch(
        prompts, max_length=max_new_tokens + max(echoed), include_prompt_in_result=False,
        **options,
    )
    return [
        [int(i) for i in r.sequences_ids[0][skip : skip + max_new_tokens]]
        for r, skip in zip(results, echoed, strict=True)
    ]


# ---------------------------------------------------------------------------------------------
# checking an export against relpos


@dataclasses.dataclass(frozen=True)
class CTranslate2Case:
    """One comparison: a batch of prompts run in both engines.

    Attributes:
        name: ``"batch 1"`` or ``"ragged batch"``.
        lengths: the prompt lengths.
        max_logprob_diff: largest ``|log p_relpos - log p_ct2|`` over every prompt position
            and the whole vocabulary.
        relpos_tokens: relpos's greedy continuation of each prompt.
        ct2_tokens: CTranslate2's.
    """

    name: str
    lengths: tuple[int, ...]
    max_logprob_diff: float
    relpos_tokens: tuple[tuple[int, ...], ...]
    ct2_tokens: tuple[tuple[int, ...], ...]

    @property
    def greedy_match(self) -> bool:
        return self.relpos_tokens == self.ct2_tokens


@dataclasses.dataclass(frozen=True)
class CTranslate2Check:
    """What :func:`check_ctranslate2` measured.

    Attributes:
        cases: the batch-1 case and the ragged-batch case.
        max_new_tokens: greedy tokens generated per prompt.
    """

    cases: tuple[CTranslate2Case, ...]
    max_new_tokens: int

    @property
    def max_logprob_diff(self) -> float:
        return max(c.max_logprob_diff for c in self.cases)

    @property
    def greedy_match(self) -> bool:
        return all(c.greedy_match for c in self.cases)

    def ok(self, atol: float = 1e-4) -> bool:
        """Log-probs within ``atol`` and identical greedy tokens."""
        return self.max_logprob_diff <= atol and self.greedy_match


def _prompts(
    prompt_ids: Any, cfg: ModelConfig, max_new_tokens: int, seed: int
) -> list[list[int]]:
    """The prompts as lists of ids: given, or drawn from ``seed``."""
    limit = cfg.max_length - max_new_tokens if cfg.positions == "learned" else None
    if limit is not None and limit < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt within "
            f"max_length={cfg.max_length} of the learned positions"
        )
    if prompt_ids is None:
        gen = torch.Generator().manual_seed(seed)
        lengths = [7, 3, 1, 10]
        if limit is not None:
            lengths = [max(1, min(n, limit)) for n in lengths]
        return [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    if isinstance(prompt_ids, Tensor):
        prompt_ids = prompt_ids.tolist() if prompt_ids.dim() == 2 else [prompt_ids.tolist()]
    try:
        prompts = [[int(i) for i in p] for p in prompt_ids]
    except (TypeError, ValueError):
        raise TypeError(
            "prompt_ids must be a (B, P) tensor or a sequence of sequences of token ids"
        ) from None
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_ids needs at least one prompt, each of at least one token")
    flat = [i for p in prompts for i in p]
    if min(flat) < 0 or max(flat) >= cfg.vocab_size:
        raise ValueError(
            f"prompt_ids must be in [0, vocab_size={cfg.vocab_size}), got values in "
            f"[{min(flat)}, {max(flat)}]"
        )
    if limit is not None and max(len(p) for p in prompts) > limit:
        raise ValueError(
            f"prompts of up to {max(len(p) for p in prompts)} tokens + {max_new_tokens} new "
            f"exceed max_length={cfg.max_length} of the learned positions"
        )
    return prompts


@torch.no_grad()
def _relpos_logprobs(model: RelativeTransformerLM, prompt: list[int]) -> Tensor:
    """``(P, V)`` float64 log-probs of one prompt, from a full forward pass."""
    device = model.embed.weight.device
    logits = model(torch.tensor([prompt], device=device))[0]  # (P, V)
    return F.log_softmax(logits.double(), dim=-1).cpu()


@torch.no_grad()
def _relpos_greedy(model: RelativeTransformerLM, prompt: list[int], n: int) -> tuple[int, ...]:
    """``n`` greedy tokens, one full forward pass each (independent of ``generate``)."""
    device = model.embed.weight.device
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids], device=device))[0, -1]  # (V,)
        ids.append(int(logits.argmax()))
    return tuple(ids[len(prompt):])


def check_ctranslate2(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    prompt_ids: Any = None,
    max_new_tokens: int = 8,
    compute_type: str = "default",
    intra_threads: int = 1,
    seed: int = 0,
) -> CTranslate2Check:
    """Run an exported directory in CTranslate2 and ``model`` in relpos on the same prompts.

    Two cases: the first prompt alone (batch 1), and every prompt at once (a ragged batch:
    prompts of different lengths). For each, the log-probs of the whole vocabulary at every
    prompt position (CTranslate2: ``Generator.forward_batch(ids, return_log_probs=True)``,
    which pads the ragged batch and masks by length; relpos: ``log_softmax`` of
    ``model(ids)``, one prompt at a time), and ``max_new_tokens`` greedy tokens
    (CTranslate2: ``generate_batch(..., sampling_topk=1, include_prompt_in_result=False,
    end_token=[])``; relpos: argmax of a full forward pass per token, not
    ``model.generate``).

    Args:
        model: the relpos model that was exported (run in eval mode, restored after).
        path: the directory :func:`to_ctranslate2` wrote.
        prompt_ids: a ``(B, P)`` tensor or B sequences of ids (different lengths allowed);
            None = 4 prompts of lengths 7, 3, 1, 10 drawn from ``seed``.
        max_new_tokens: greedy tokens per prompt.
        compute_type: CTranslate2's compute type (see :func:`load_generator`).
        intra_threads: CTranslate2 threads.
        seed: draws the default prompts.

    Returns:
        A :class:`CTranslate2Check`; ``.max_logprob_diff``, ``.greedy_match``, ``.ok(atol)``.

    Raises:
        CTranslate2ExportError: ``model`` cannot be exported (so it cannot match).
        CTranslate2MissingError: ``ctranslate2`` is not installed.
    """
    lm = _check_model(model)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
        max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    meta = read_metadata(path)
    # The metadata went through JSON (a window (K, K) reads back as [K, K]): compare as JSON.
    if meta.get("config") != json.loads(json.dumps(lm.config.to_dict())):
        raise CTranslate2ExportError(
            f"{str(path)!r} was exported from another configuration than this model's"
        )
    prompts = _prompts(prompt_ids, lm.config, max_new_tokens, seed)
    tokens = load_vocabulary(path)
    generator = load_generator(path, compute_type=compute_type, intra_threads=intra_threads)
    reference = copy.deepcopy(lm).float().eval() if lm.embed.weight.dtype != torch.float32 else lm
    was_training = lm.training
    reference.eval()
    try:
        cases = [
            _case(generator, reference, tokens, name, batch, max_new_tokens)
            for name, batch in (("batch 1", prompts[:1]), ("ragged batch", prompts))
            if name == "batch 1" or len(prompts) > 1
        ]
    finally:
        lm.train(was_training)
    return CTranslate2Check(tuple(cases), max_new_tokens)


def _case(
    generator: Any, model: RelativeTransformerLM, tokens: list[str], name: str,
    prompts: list[list[int]], n: int,
) -> CTranslate2Case:
    import numpy as np

    out = np.asarray(generator.forward_batch(prompts, return_log_probs=True))  # (B, P, V)
    worst = 0.0
    for b, prompt in enumerate(prompts):
        got = torch.from_numpy(out[b, : len(prompt)].astype(np.float64))  # (P, V)
        want = _relpos_logprobs(model, prompt)
        diff = float((got - want).abs().max())
        worst = max(worst, diff if math.isfinite(diff) else math.inf)  # NaN counts as inf
    new = generate_new_tokens(generator, [[tokens[i] for i in p] for p in prompts], n)
    ct2_tokens = tuple(tuple(seq) for seq in new)
    relpos_tokens = tuple(_relpos_greedy(model, p, n) for p in prompts)
    return CTranslate2Case(
        name, tuple(len(p) for p in prompts), worst, relpos_tokens, ct2_tokens
    )
