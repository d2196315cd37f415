"""Saving relpos modules and exporting them to ONNX.

A saved module is ONE file written by :func:`save_module` with ``torch.save`` (loaded back with
``torch.load(..., weights_only=True)``, so loading runs no pickled code)::

    {"format": "relpos.module", "format_version": 1, "relpos_version": "0.1.0",
     "class": "RelativeTransformerEncoderLayer", "config": {...constructor arguments...},
     "state_dict": {...CPU tensors, including each attention's _extra_state...}}

:func:`load_module` rebuilds the module from ``class`` and ``config`` and loads the state (the
state's format version, clip window and offset convention are checked, see
:mod:`relpos.versioning`). A window ``max_distance=(left, right)`` is written to the JSON
config as a list ``[left, right]`` and comes back as the pair. It also reads a training
checkpoint directory written by ``relpos train`` (``latest.json`` + ``model.safetensors`` +
``state.json``).

:func:`export_onnx` exports with the ``torch.export``-based exporter
(``torch.onnx.export(..., dynamo=True)``) with dynamic batch and sequence axes: the ONNX graph
computes the relative index from the runtime length, so it serves every length, not only the
example's. It runs the bucketed backend. ONNX needs the ``onnx`` extra
(``pip install 'relpos[onnx]'``: onnx, onnxscript, onnxruntime).

:func:`to_ctranslate2` and :func:`check_ctranslate2` (language models to a CTranslate2
directory, and the comparison of both engines) are those of
:mod:`relpos.integrations.ctranslate2`, loaded on first use; they need the ``ct2`` extra
(``pip install 'relpos[ct2]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from relpos._io import atomic_save
from relpos._version import __version__
from relpos.models import ModelConfig, RelativeTransformerEncoderModel, RelativeTransformerLM
from relpos.modules import (
    RelativeMultiheadAttention,
    RelativeTransformerDecoderLayer,
    RelativeTransformerEncoderLayer,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ModuleFormatError",
    "build_module",
    "check_ctranslate2",
    "check_onnx",
    "export_onnx",
    "load_module",
    "module_config",
    "require_onnx",
    "save_module",
    "to_ctranslate2",
]

FORMAT = "relpos.module"
FORMAT_VERSION = 1
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
_MODELS = (RelativeTransformerLM, RelativeTransformerEncoderModel)


class ModuleFormatError(ValueError):
    """A file is not a saved relpos module, or describes one relpos cannot rebuild."""


# Loaded on first use (PEP 562): relpos.integrations.ctranslate2, which imports ctranslate2
# only when it exports or checks.
_CTRANSLATE2 = ("check_ctranslate2", "to_ctranslate2")


def __getattr__(name: str) -> Any:
    if name in _CTRANSLATE2:
        from relpos.integrations import ctranslate2

        value = getattr(ctranslate2, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'relpos.export' has no attribute {name!r}")


if TYPE_CHECKING:  # static analysers see the eager import
    from relpos.integrations.ctranslate2 import check_ctranslate2, to_ctranslate2


# ---------------------------------------------------------------------------------------------
# configs: a registry of the classes a saved module may name


@dataclasses.dataclass(frozen=True)
class _Entry:
    """How one class is written to a saved module's ``config`` and rebuilt from it."""

    cls: type[nn.Module]
    config: Callable[[Any], dict[str, Any]]  # module -> plain-data (JSON) config
    build: Callable[[dict[str, Any]], nn.Module]  # that config -> a fresh module


def _constructed(cls: Any) -> _Entry:
    """A relpos module whose ``get_config()`` is its constructor's keyword arguments."""
    return _Entry(cls, lambda m: m.get_config(), lambda config: cls(**config))


def _model(cls: Any) -> _Entry:
    """A model of :mod:`relpos.models`: saved as ``ModelConfig.to_dict()``, as a checkpoint."""
    return _Entry(
        cls, lambda m: m.get_config()["config"].to_dict(),
        lambda config: cls(config=ModelConfig.from_dict(config)),
    )


def _stack_config(module: nn.TransformerEncoder) -> dict[str, Any]:
    first = module.layers[0] if len(module.layers) else None
    if not isinstance(first, RelativeTransformerEncoderLayer):
        raise ModuleFormatError(
            "can only save an nn.TransformerEncoder of relpos.RelativeTransformerEncoderLayer"
        )
    norm = module.norm
    if norm is not None and not isinstance(norm, nn.LayerNorm):
        raise ModuleFormatError(f"unsupported final norm {type(norm).__name__}")
    return {
        "layer": first.get_config(), "num_layers": len(module.layers),
        "norm_eps": None if norm is None else norm.eps,
        "norm_bias": None if norm is None else norm.bias is not None,
    }


def _build_stack(config: dict[str, Any]) -> nn.TransformerEncoder:
    layer = RelativeTransformerEncoderLayer(**config["layer"])
    norm = None
    if config.get("norm_eps") is not None:
        norm = nn.LayerNorm(
            layer.self_attn.embed_dim, eps=config["norm_eps"],
            bias=bool(config.get("norm_bias", True)),
        )
    return nn.TransformerEncoder(
        layer,  # type: ignore[arg-type]  # any layer with the same forward works
        int(config["num_layers"]), norm=norm, enable_nested_tensor=False,
    )


# Saved "class" name -> entry. The names are the file format: never rename one.
_REGISTRY: dict[str, _Entry] = {
    "RelativeMultiheadAttention": _constructed(RelativeMultiheadAttention),
    "RelativeTransformerEncoderLayer": _constructed(RelativeTransformerEncoderLayer),
    "RelativeTransformerDecoderLayer": _constructed(RelativeTransformerDecoderLayer),
    "TransformerEncoder": _Entry(nn.TransformerEncoder, _stack_config, _build_stack),
    "RelativeTransformerLM": _model(RelativeTransformerLM),
    "RelativeTransformerEncoderModel": _model(RelativeTransformerEncoderModel),
}
_NAMES: dict[type[nn.Module], str] = {entry.cls: name for name, entry in _REGISTRY.items()}


def module_config(module: nn.Module) -> dict[str, Any]:
    """``{"class": name, "config": {...}}`` from which :func:`build_module` rebuilds ``module``.

    Supported: :class:`relpos.RelativeMultiheadAttention`,
    :class:`relpos.RelativeTransformerEncoderLayer`,
    :class:`relpos.RelativeTransformerDecoderLayer` (their ``get_config()``),
    ``nn.TransformerEncoder`` of relpos encoder layers and the models of :mod:`relpos.models`
    (their ``ModelConfig`` as a dict). A subclass is saved as the class it derives from.

    Raises:
        ModuleFormatError: for any other module, or a layer with a custom activation.
    """
    name = next((_NAMES[c] for c in type(module).__mro__ if c in _NAMES), None)
    if name is None:
        raise ModuleFormatError(
            f"cannot save a {type(module).__name__}; allowed: {', '.join(_REGISTRY)} (an "
            f"nn.TransformerEncoder of relpos encoder layers)"
        )
    try:
        config = _REGISTRY[name].config(module)
    except ModuleFormatError:
        raise
    except ValueError as err:
        raise ModuleFormatError(f"cannot save a {type(module).__name__}: {err}") from None
    return {"class": name, "config": config}


def build_module(spec: Mapping[str, Any]) -> nn.Module:
    """Build a freshly initialized module from a :func:`module_config` dict.

    Raises:
        ModuleFormatError: if ``spec`` names an unknown class or holds bad arguments.
    """
    try:
        name, config = spec["class"], dict(spec["config"])
    except (KeyError, TypeError):
        raise ModuleFormatError("a module spec needs 'class' and 'config' entries") from None
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ModuleFormatError(
            f"unknown module class {name!r} in a saved relpos module; allowed: "
            f"{', '.join(_REGISTRY)}"
        )
    try:
        return entry.build(config)
    except (KeyError, TypeError) as err:
        raise ModuleFormatError(f"bad config for {name}: {err}") from None


# ---------------------------------------------------------------------------------------------
# save / load


def save_module(module: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Save ``module`` (configuration + weights) to one file, atomically.

    The argument order follows ``torch.save(obj, path)``; the order of relpos 0.1,
    ``save_module(path, module)``, still works and warns.

    Args:
        module: a module :func:`module_config` supports.
        path: destination file (conventionally ``*.pt``).

    Returns:
        The path written.

    Raises:
        ModuleFormatError: if the module type cannot be saved.
        TypeError: if neither argument is a module.

    Example:
        >>> layer = relpos.RelativeTransformerEncoderLayer(16, 2, 32, max_distance=4)
        >>> path = save_module(layer, Path(tempfile.mkdtemp()) / "layer.pt")
        >>> type(load_module(path)).__name__
        'RelativeTransformerEncoderLayer'
    """
    if isinstance(path, nn.Module) and isinstance(module, (str, os.PathLike)):
        warnings.warn(
            "save_module(path, module) is deprecated: pass the module first, as in "
            "torch.save(obj, path)", DeprecationWarning, stacklevel=2,
        )
        module, path = path, module
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"save_module(module, path) needs an nn.Module first, got {type(module).__name__}"
        )
    spec = module_config(module)
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "relpos_version": __version__,
        "class": spec["class"],
        # JSON text: the config is plain data, and weights_only loading accepts a str.
        "config": json.dumps(spec["config"]),
        "state_dict": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_save(Path(path), lambda tmp: torch.save(payload, tmp))


def load_module(path: str | os.PathLike[str]) -> nn.Module:
    """Load a module saved by :func:`save_module`, or a ``relpos train`` run: its ``--out``
    directory or the ``checkpoints/`` directory in it (as every ``relpos`` command takes).

    The module comes back on CPU, in eval mode.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ModuleFormatError: if it is not a saved relpos module of a known format version.
        relpos.versioning.RelativeStateError: if its tables use another convention.
    """
    p = Path(path)
    if p.is_dir():
        return _load_checkpoint_dir(p)
    if not p.exists():
        raise FileNotFoundError(f"no such file: {str(p)!r}")
    try:
        payload = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ModuleFormatError(
            f"{str(p)!r} is not a saved relpos module (relpos.export.save_module): "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ModuleFormatError(
            f"{str(p)!r} is not a saved relpos module (relpos.export.save_module); a bare "
            f"state_dict does not say which module to build"
        )
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise ModuleFormatError(
            f"{str(p)!r} has relpos module format version {version!r}; this relpos reads "
            f"version {FORMAT_VERSION}"
        )
    try:
        config = json.loads(payload["config"])
        state = payload["state_dict"]
    except (KeyError, TypeError, ValueError) as err:
        raise ModuleFormatError(f"damaged relpos module file {str(p)!r}: {err}") from None
    module = build_module({"class": payload.get("class"), "config": config})
    module.load_state_dict(state)
    return module.eval()


def _load_checkpoint_dir(root: Path) -> nn.Module:
    if not (root / "latest.json").is_file() and (root / "checkpoints" / "latest.json").is_file():
        root = root / "checkpoints"  # a relpos train --out directory
    if not (root / "latest.json").is_file():
        raise ModuleFormatError(
            f"{str(root)!r} is a directory without a training checkpoint: neither latest.json "
            "nor checkpoints/latest.json; allowed: a relpos train --out directory, its "
            "checkpoints/, or a file saved with save_module"
        )
    from relpos.training.checkpoint import load_checkpoint

    ckpt = load_checkpoint(root)
    config = ckpt.state.get("model")
    if not isinstance(config, dict):
        raise ModuleFormatError(f"checkpoint {str(ckpt.path)!r} has no model config")
    cls = RelativeTransformerLM if config.get("causal", True) else RelativeTransformerEncoderModel
    module = build_module({"class": _NAMES[cls], "config": config})
    module.load_state_dict(ckpt.model_state)
    return module.eval()


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
    if isinstance(module, _MODELS):
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
            f"{', '.join(cls.__name__ for cls in _MODELS)}"
        )
    dtype = attn.out_proj.weight.dtype
    if attn.kdim != attn.embed_dim or attn.vdim != attn.embed_dim:
        raise ValueError("ONNX export serves self-attention: needs kdim == vdim == embed_dim")
    batch, length = (0, 1) if attn.batch_first else (1, 0)
    return "x", batch, length, attn.embed_dim, dtype


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
    if isinstance(example_length, bool) or not isinstance(example_length, int) or (
        example_length < 2
    ):
        raise ValueError(f"example_length must be an int >= 2, got {example_length!r}")
    if isinstance(example_batch, bool) or not isinstance(example_batch, int) or (
        example_batch < 2
    ):
        raise ValueError(f"example_batch must be an int >= 2, got {example_batch!r}")
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
