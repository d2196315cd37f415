"""Exporting relpos modules to ONNX, and checking the export against torch.

:func:`export_onnx` exports with the ``torch.export``-based exporter
(``torch.onnx.export(..., dynamo=True)``) with dynamic batch and sequence axes: the ONNX graph
computes the relative index from the runtime length, so it serves every length, not only the
example's. It runs the bucketed backend. ONNX needs the ``onnx`` extra
(``pip install 'relpos[onnx]'``: onnx, onnxscript, onnxruntime).

:func:`export_speech_encoder` does the same for a Hugging Face speech encoder patched with
:func:`relpos.integrations.transformers.patch` (w2v-BERT 2.0's ``Wav2Vec2BertModel``,
SeamlessM4T v2's ``SeamlessM4Tv2SpeechEncoder``): inputs ``input_features`` and
``attention_mask``, output ``last_hidden_state``, dynamic batch and length. Stock
``transformers`` attention does not export with a dynamic length (sdpa's reshape fails in the
exporter), so an unpatched model is refused; :func:`check_speech_encoder` compares the file with
any torch model (the stock one, for instance) on padded batches.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from relpos._io import atomic_save
from relpos.export.saving import MODELS
from relpos.modules import RelativeMultiheadAttention, RelativeTransformerEncoderLayer

__all__ = [
    "ONNX_PACKAGES",
    "SPEECH_ENCODERS",
    "check_onnx",
    "check_speech_encoder",
    "export_onnx",
    "export_speech_encoder",
    "require_onnx",
]

ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")

# ---------------------------------------------------------------------------------------------
# ONNX


def require_onnx() -> None:
    """Raise a one-line ``ImportError`` naming the ``onnx`` extra if a package is missing."""
    missing = [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"ONNX export needs the 'onnx' extra: pip install 'relpos[onnx]' "
            f"(missing: {', '.join(missing)})"
        )


class _OnnxWrapper(nn.Module):
    """One tensor in (features or token ids, optional key mask), one tensor out.

    ``key_mask`` is relpos's (``(B, L)`` bool, True = real token) and reaches the attention
    as it is.
    """

    def __init__(self, module: nn.Module, *, is_causal: bool) -> None:
        super().__init__()
        self.module = module
        self.is_causal = is_causal

    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        m = self.module
        if isinstance(m, RelativeMultiheadAttention):
            out, _ = m(x, need_weights=False, is_causal=self.is_causal, key_mask=key_mask)
            return out
        if isinstance(m, RelativeTransformerEncoderLayer):
            return m(x, key_mask=key_mask, is_causal=self.is_causal)
        if isinstance(m, nn.TransformerEncoder):
            # nn.TransformerEncoder.forward takes PyTorch's padding mask only: run its layers.
            for layer in m.layers:
                x = layer(x, key_mask=key_mask, is_causal=self.is_causal)
            return x if m.norm is None else m.norm(x)
        # relpos.models: skip the id range check of forward (data-dependent, not exportable).
        model: Any = m
        return model.logits(model.hidden(x, key_mask, None, is_causal=model.config.causal))


def _io_layout(module: nn.Module) -> tuple[str, int, int, int | None, torch.dtype]:
    """(input name, batch axis, length axis, feature size or None for ids, input dtype)."""
    if isinstance(module, MODELS):
        return "ids", 0, 1, None, torch.long
    if isinstance(module, RelativeMultiheadAttention):
        attn = module
    elif isinstance(module, RelativeTransformerEncoderLayer):
        attn = module.self_attn
    elif isinstance(module, nn.TransformerEncoder) and isinstance(
        module.layers[0], RelativeTransformerEncoderLayer
    ):
        attn = module.layers[0].self_attn
    else:
        raise TypeError(
            f"cannot export a {type(module).__name__} to ONNX; allowed: "
            f"RelativeMultiheadAttention (self-attention), RelativeTransformerEncoderLayer, "
            f"nn.TransformerEncoder of those, "
            f"{', '.join(cls.__name__ for cls in MODELS)}"
        )
    dtype = attn.out_proj.weight.dtype
    if attn.kdim != attn.embed_dim or attn.vdim != attn.embed_dim:
        raise ValueError("ONNX export serves self-attention: needs kdim == vdim == embed_dim")
    batch, length = (0, 1) if attn.batch_first else (1, 0)
    return "x", batch, length, attn.embed_dim, dtype


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _example(module: nn.Module, batch_size: int, length: int) -> Tensor:
    _, b_axis, l_axis, features, dtype = _io_layout(module)
    if features is None:
        config: Any = module.config
        vocab = int(config.vocab_size)
        return torch.randint(0, vocab, (batch_size, length))
    shape = [0, 0, features]
    shape[b_axis], shape[l_axis] = batch_size, length
    return torch.randn(*shape, dtype=dtype)


def export_onnx(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    is_causal: bool = False,
    key_mask: bool = False,
    example_length: int = 7,
    example_batch: int = 2,
    opset_version: int | None = None,
    optimize: bool = True,
) -> Path:
    """Export ``module`` to an ONNX file with dynamic batch and sequence axes, atomically.

    The graph takes ``x`` (features, laid out as the module's ``batch_first`` says) or ``ids``
    (``(B, L)`` token ids, for the models of :mod:`relpos.models`), plus ``key_mask``
    (``(B, L)`` bool, True = real token) when ``key_mask`` is set, and returns ``out``. Attention
    runs the bucketed backend whatever the module's ``implementation``; it gives the same
    numbers as the other backends.

    Args:
        module: see :func:`module_config` (decoder layers and cross-attention are not exported).
        path: destination ``.onnx`` file.
        is_causal: export causal self-attention (the models use their own config).
        key_mask: add the ``key_mask`` input.
        example_length: L of the tracing example; the exported graph serves every length.
        example_batch: B of the tracing example (>= 2, so the batch axis stays dynamic).
        opset_version: ONNX opset (None = the exporter's default).
        optimize: run the exporter's graph optimizer.

    Returns:
        The path written.

    Raises:
        ImportError: if the ``onnx`` extra is not installed (one line).
        TypeError, ValueError: for a module that cannot be exported or bad sizes.
    """
    require_onnx()
    _check_int("example_length", example_length, 2)
    _check_int("example_batch", example_batch, 2)
    name, b_axis, l_axis, _, _ = _io_layout(module)
    x = _example(module, example_batch, example_length)
    wrapper = _OnnxWrapper(module, is_causal=bool(is_causal))
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    length = torch.export.Dim("length", min=1, max=1 << 20)
    args: tuple[Tensor, ...] = (x,)
    dynamic: dict[str, Any] = {"x": {b_axis: batch, l_axis: length}}
    input_names = [name]
    if key_mask:
        args = (x, torch.ones(example_batch, example_length, dtype=torch.bool))
        dynamic["key_mask"] = {0: batch, 1: length}
        input_names.append("key_mask")
    was_training = module.training
    wrapper.eval()
    try:
        with _backend("bucketed", module), torch.no_grad(), warnings.catch_warnings():
            # x and key_mask share their axes on purpose; the exporter says so at length.
            warnings.filterwarnings("ignore", message=".*shares the same shape constraints")
            program = torch.onnx.export(
                wrapper, args, dynamo=True, dynamic_shapes=dynamic, input_names=input_names,
                output_names=["out"], opset_version=opset_version, optimize=optimize,
                verbose=False,
            )
    except Exception as err:
        raise RuntimeError(
            f"ONNX export of {type(module).__name__} failed: {_summary(err)}"
        ) from err
    finally:
        module.train(was_training)
    assert program is not None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_save(Path(path), lambda tmp: program.save(tmp))


def _summary(err: BaseException) -> str:
    """The informative line of a (long, multi-section) exporter error."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("<class '"):
            return line
    return lines[0] if lines else type(err).__name__


@contextlib.contextmanager
def _backend(name: str, module: nn.Module) -> Any:
    """Temporarily route every relpos attention in ``module`` to backend ``name``."""
    attns = [m for m in module.modules() if isinstance(m, RelativeMultiheadAttention)]
    saved = [m.implementation for m in attns]
    for m in attns:
        m.implementation = name  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, impl in zip(attns, saved, strict=True):
            m.implementation = impl


def check_onnx(
    path: str | os.PathLike[str],
    module: nn.Module,
    lengths: Iterable[int] = (1, 5, 16),
    *,
    batch_size: int = 3,
    is_causal: bool = False,
    key_mask: bool = False,
    seed: int = 0,
) -> float:
    """Run an exported file in onnxruntime and compare it to ``module`` at several lengths.

    Returns:
        The largest absolute difference over all lengths.

    Raises:
        ImportError: if onnxruntime is missing (one line).
    """
    require_onnx()
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    torch_module = _OnnxWrapper(module, is_causal=is_causal).eval()
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for n in lengths:
        with torch.random.fork_rng():
            torch.manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
            x = _example(module, batch_size, n)
        feeds = {names[0]: x.numpy()}
        args: tuple[Tensor, ...] = (x,)
        if key_mask:
            km = torch.rand(batch_size, n, generator=gen) > 0.3
            km[:, -1] = True
            feeds[names[1]] = km.numpy()
            args = (x, km)
        got = torch.from_numpy(session.run(None, feeds)[0])
        with torch.no_grad():
            want = torch_module(*args)
        worst = max(worst, float((got.to(want.dtype) - want).abs().max()))
    return worst


# ---------------------------------------------------------------------------------------------
# Hugging Face speech encoders patched with relpos.integrations.transformers

SPEECH_ENCODERS: dict[str, str] = {
    "Wav2Vec2BertModel": "transformers.models.wav2vec2_bert.modeling_wav2vec2_bert",
    "SeamlessM4Tv2SpeechEncoder": "transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2",
}
"""The ``transformers`` classes :func:`export_speech_encoder` exports, by name, with the module
that defines them."""

#: The dtypes the exported ``attention_mask`` input may have (1 = real frame, 0 = padding).
MASK_DTYPES = (torch.int64, torch.int32, torch.bool)


class _SpeechEncoderWrapper(nn.Module):
    """``(input_features, attention_mask)`` in, ``last_hidden_state`` out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_features: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        out = self.model(input_features, attention_mask=attention_mask)
        return out.last_hidden_state


def _speech_encoder_class_name(model: object) -> str:
    """The name in :data:`SPEECH_ENCODERS` of ``model``'s class, or a ``TypeError``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"export_speech_encoder expects a transformers speech encoder (nn.Module), got "
            f"{type(model).__name__}"
        )
    for cls in type(model).__mro__:
        module = SPEECH_ENCODERS.get(cls.__name__)
        if module is not None and cls.__module__ == module:
            return cls.__name__
    hint = ""
    if isinstance(getattr(model, "speech_encoder", None), nn.Module):
        hint = "; pass its speech encoder, model.speech_encoder"
    raise TypeError(
        f"cannot export a {type(model).__name__} as a speech encoder; allowed: "
        f"{', '.join(SPEECH_ENCODERS)}{hint}"
    )


def _feature_size(model: nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    size = getattr(config, "feature_projection_input_dim", None)
    if not isinstance(size, int):
        raise ValueError(
            f"{type(model).__name__}.config has no feature_projection_input_dim (got {size!r})"
        )
    return size


def export_speech_encoder(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    attention_mask: bool = True,
    mask_dtype: torch.dtype = torch.int64,
    example_length: int = 16,
    example_batch: int = 2,
    opset_version: int | None = None,
    optimize: bool = True,
) -> Path:
    """Export a relpos-patched Hugging Face speech encoder to ONNX, atomically.

    The graph takes ``input_features`` ``(batch, length, feature_projection_input_dim)`` (the
    model's float dtype) and, with ``attention_mask`` (the default), ``attention_mask``
    ``(batch, length)`` of ``mask_dtype`` (1 = real frame, 0 = padding, as the feature
    extractor returns it: its numpy mask is int32), and returns ``last_hidden_state``
    ``(batch, frames, hidden_size)`` (``frames`` = ``length``, or fewer when the model has an
    adapter that subsamples). Batch and length are dynamic: one file serves every batch size
    and every length. The model is exported in eval mode (no dropout, no SpecAugment) and left
    in the mode it was in.

    Args:
        model: a ``Wav2Vec2BertModel`` or ``SeamlessM4Tv2SpeechEncoder`` (see
            :data:`SPEECH_ENCODERS`) patched with
            :func:`relpos.integrations.transformers.patch`.
        path: destination ``.onnx`` file (its directory is created).
        attention_mask: add the ``attention_mask`` input.
        mask_dtype: its dtype: ``torch.int64``, ``torch.int32`` or ``torch.bool``.
        example_length, example_batch, opset_version, optimize: as in :func:`export_onnx`.

    Returns:
        The path written.

    Raises:
        ImportError: if the ``onnx`` extra is not installed (one line).
        TypeError: for a model of another class (a whole ``SeamlessM4Tv2Model``: pass its
            ``speech_encoder``) or a ``mask_dtype`` not allowed.
        ValueError: for a model not patched by relpos (patch it first) or bad sizes.
        RuntimeError: if the exporter fails (its one informative line).
    """
    from relpos.integrations.transformers import is_patched

    name = _speech_encoder_class_name(model)
    if not is_patched(model):
        raise ValueError(
            f"this {name} is not patched: its attention is transformers' own, which "
            "torch.onnx.export(dynamo=True) cannot export with a dynamic length (sdpa fails "
            "in its reshape); call relpos.integrations.transformers.patch(model) first"
        )
    if mask_dtype not in MASK_DTYPES:
        raise TypeError(
            f"mask_dtype must be one of {', '.join(map(str, MASK_DTYPES))}, got {mask_dtype!r}"
        )
    _check_int("example_length", example_length, 2)
    _check_int("example_batch", example_batch, 2)
    require_onnx()
    features = _feature_size(model)
    dtype = next(model.parameters()).dtype
    x = torch.randn(example_batch, example_length, features, dtype=dtype)
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    length = torch.export.Dim("length", min=1, max=1 << 20)
    args: tuple[Tensor, ...] = (x,)
    dynamic: dict[str, Any] = {"input_features": {0: batch, 1: length}}
    input_names = ["input_features"]
    if attention_mask:
        args = (x, torch.ones(example_batch, example_length, dtype=mask_dtype))
        dynamic["attention_mask"] = {0: batch, 1: length}
        input_names.append("attention_mask")
    wrapper = _SpeechEncoderWrapper(model)
    was_training = model.training
    wrapper.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*shares the same shape constraints")
            program = torch.onnx.export(
                wrapper, args, dynamo=True, dynamic_shapes=dynamic, input_names=input_names,
                output_names=["last_hidden_state"], opset_version=opset_version,
                optimize=optimize, verbose=False,
            )
    except Exception as err:
        raise RuntimeError(f"ONNX export of {name} failed: {_summary(err)}") from err
    finally:
        model.train(was_training)
    assert program is not None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_save(Path(path), lambda tmp: program.save(tmp))


def _real_frames(model: nn.Module, mask: Tensor, frames: int) -> Tensor:
    """``(B, frames)`` bool: the output frames of ``model`` that come from real input frames
    (``mask``: ``(B, L)``, right padding), its adapter's subsampling included."""
    lengths = mask.long().sum(1)
    adapter: Any = getattr(model, "adapter", None)
    if frames != mask.shape[1] and adapter is not None:
        sub = getattr(model, "_compute_sub_sample_lengths_from_attention_mask", None)
        if sub is not None:  # SeamlessM4T v2: one formula for the whole adapter
            lengths = sub(mask).long()
        else:  # w2v-BERT: each adapter layer subsamples
            seq = lengths.float()
            for _ in adapter.layers:
                seq = adapter._compute_sub_sample_lengths_from_attention_mask(seq)
            lengths = seq.long()
    return torch.arange(frames)[None, :] < lengths[:, None]


def check_speech_encoder(
    path: str | os.PathLike[str],
    model: nn.Module,
    lengths: Iterable[int] = (5, 16, 37),
    *,
    batch_size: int = 3,
    seed: int = 0,
) -> float:
    """Run a file written by :func:`export_speech_encoder` in onnxruntime and compare it with
    ``model`` (any torch speech encoder of the same weights: the patched one, or the stock one
    with ``eager`` or ``sdpa`` attention) at several lengths.

    Each length runs a batch of ``batch_size`` random feature rows: the first row is full, the
    others right-padded to random lengths (with an ``attention_mask`` input; without one, every
    row is full). Only real frames are compared (padded frames are not part of the output).

    Returns:
        The largest absolute difference over all lengths.

    Raises:
        ImportError: if onnxruntime is missing (one line).
        ValueError: for bad sizes.
    """
    _check_int("batch_size", batch_size, 1)
    lengths = [_check_int("length", n, 1) for n in lengths]
    require_onnx()
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.type for i in session.get_inputs()}
    masked = "attention_mask" in inputs
    mask_dtype = {"tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
                  "tensor(bool)": torch.bool}.get(inputs.get("attention_mask", ""), torch.int64)
    features = _feature_size(model)
    dtype = next(model.parameters()).dtype
    reference = _SpeechEncoderWrapper(model)
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    try:
        for n in lengths:
            x = torch.randn(batch_size, n, features, generator=gen).to(dtype)
            real = torch.full((batch_size,), n)
            if masked and n > 1:
                real[1:] = torch.randint(1, n + 1, (batch_size - 1,), generator=gen)
            mask = (torch.arange(n)[None, :] < real[:, None]).to(mask_dtype)
            feeds = {"input_features": x.numpy()}
            if masked:
                feeds["attention_mask"] = mask.numpy()
            got = torch.from_numpy(session.run(None, feeds)[0])
            with torch.no_grad():
                want = reference(x, mask if masked else None)
            keep = _real_frames(model, mask, want.shape[1])
            worst = max(worst, float((got.to(want.dtype) - want)[keep].abs().max()))
    finally:
        model.train(was_training)
    return worst
