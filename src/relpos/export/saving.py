"""Saving relpos modules to one file and rebuilding them.

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
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
    "MODELS",
    "ModuleFormatError",
    "build_module",
    "load_module",
    "module_config",
    "save_module",
]

FORMAT = "relpos.module"
FORMAT_VERSION = 1
#: The model classes a saved module may name (the others are modules of :mod:`relpos.modules`).
MODELS = (RelativeTransformerLM, RelativeTransformerEncoderModel)


class ModuleFormatError(ValueError):
    """A file is not a saved relpos module, or describes one relpos cannot rebuild."""

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
        >>> import tempfile
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

