"""Crash-safe checkpoints: safetensors for tensors, JSON for everything else.

Layout of a checkpoint directory (``<out>/checkpoints``)::

    latest.json                    manifest: {"format_version": 1, "checkpoint": "step-..."}
    step-00000100-<token>/
        model.safetensors          the model's weights
        optimizer.safetensors      optimizer state tensors and the torch RNG states
        state.json                 step, configs, history, optimizer hyper-parameters and
                                   the sha256 of both safetensors files

A checkpoint is first written into a fresh temporary directory (every file fsynced, then the
directory), renamed to its final unique name, and only then does the manifest - written to
a temporary file, fsynced and renamed over ``latest.json``, followed by an fsync of the
directory - point at it. A crash at any moment leaves ``latest.json`` naming a complete
checkpoint (the new one or the previous one); the hashes in ``state.json`` catch files
damaged later. Older checkpoints are removed only after the manifest moved on.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from relpos._io import atomic_write_bytes, fsync_dir

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "atomic_write_bytes",
    "atomic_write_json",
    "load_checkpoint",
    "optimizer_state_from_parts",
    "optimizer_state_to_parts",
    "save_checkpoint",
]

#: Version of the on-disk format; a reader refuses other versions.
FORMAT_VERSION = 1
MANIFEST = "latest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or of an unknown format."""


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: the step directory it was read from.
        model_state: parameter name -> tensor (CPU).
        optimizer_state: a ``torch.optim.Optimizer.state_dict()``.
        rng_state: ``"torch"`` -> CPU RNG state; ``"cuda.<n>"`` -> CUDA RNG states.
        state: the JSON document (``step``, ``model``, ``task``, ``train``, ``history``...).
    """

    path: Path
    model_state: dict[str, Tensor]
    optimizer_state: dict[str, Any]
    rng_state: dict[str, Tensor]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write_json(path: str | os.PathLike[str], document: Any) -> Path:
    """Write ``document`` as indented JSON to ``path`` atomically."""
    return atomic_write_bytes(path, (json.dumps(document, indent=2) + "\n").encode())


def optimizer_state_to_parts(state_dict: dict[str, Any]) -> tuple[dict[str, Tensor], dict]:
    """Split an optimizer ``state_dict`` into tensors (``state.<param>.<name>``) and JSON."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_state_from_parts(tensors: dict[str, Tensor], document: dict) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_to_parts`."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, entries in document.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(entries)
    # JSON turns tuples (AdamW's betas) into lists; give them back their type.
    groups = [
        {k: tuple(v) if k != "params" and isinstance(v, list) else v for k, v in g.items()}
        for g in document["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model_state: dict[str, Tensor],
    optimizer_state: dict[str, Any],
    state: dict[str, Any],
    rng_state: dict[str, Tensor] | None = None,
    keep: int = 2,
) -> Path:
    """Write a checkpoint and point ``latest.json`` at it, crash-safely.

    Args:
        directory: the checkpoint directory (created if missing).
        model_state: the model's ``state_dict()``; tied tensors are stored once per name.
        optimizer_state: the optimizer's ``state_dict()``.
        state: JSON-able document; must hold ``step`` (int).
        rng_state: name -> RNG state tensor (see :class:`Checkpoint`).
        keep: how many step directories to keep (>= 1), newest first.

    Returns:
        The step directory written.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    # Clone: safetensors refuses tensors sharing storage (a tied embedding / LM head).
    weights = {k: v.detach().cpu().clone().contiguous() for k, v in model_state.items()}
    opt_tensors, opt_doc = optimizer_state_to_parts(optimizer_state)
    for name, tensor in (rng_state or {}).items():
        opt_tensors[f"rng.{name}"] = tensor.detach().cpu().contiguous()
    model_bytes = st_save(weights, metadata={"format_version": str(FORMAT_VERSION)})
    opt_bytes = st_save(opt_tensors, metadata={"format_version": str(FORMAT_VERSION)})
    document = dict(state)
    document["format_version"] = FORMAT_VERSION
    document["optimizer"] = opt_doc
    document["files"] = {MODEL_FILE: _sha256(model_bytes), OPTIMIZER_FILE: _sha256(opt_bytes)}

    name = f"step-{step:08d}-{secrets.token_hex(4)}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700 directories
        _write_synced(tmp / MODEL_FILE, model_bytes)
        _write_synced(tmp / OPTIMIZER_FILE, opt_bytes)
        _write_synced(tmp / STATE_FILE, (json.dumps(document, indent=2) + "\n").encode())
        fsync_dir(tmp)
        os.replace(tmp, root / name)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_json(root / MANIFEST, {"format_version": FORMAT_VERSION, "checkpoint": name})
    _prune(root, current=name, keep=keep)
    return root / name


def _prune(root: Path, *, current: str, keep: int) -> None:
    steps = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")),
        key=lambda p: (p.name != current, -p.stat().st_mtime_ns),
    )
    for old in steps[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):  # from an interrupted save
        shutil.rmtree(leftover, ignore_errors=True)


def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a checkpoint manifest."""
    return (Path(directory) / MANIFEST).is_file()


def load_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    """Read the checkpoint ``latest.json`` names, verifying format and hashes.

    Raises:
        CheckpointError: if there is no checkpoint, its format version is unknown or a file
            is missing or does not match its recorded hash.
    """
    root = Path(directory)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"no checkpoint in {str(root)!r} (missing {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
        step_dir = root / str(manifest["checkpoint"])
        version = manifest.get("format_version")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"damaged checkpoint manifest {str(manifest_path)!r}: {err}"
        ) from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(root)!r} has format version {version!r}; this relpos reads "
            f"version {FORMAT_VERSION}"
        )
    try:
        document = json.loads((step_dir / STATE_FILE).read_text())
        model_bytes = (step_dir / MODEL_FILE).read_bytes()
        opt_bytes = (step_dir / OPTIMIZER_FILE).read_bytes()
    except (OSError, ValueError) as err:
        raise CheckpointError(f"damaged checkpoint {str(step_dir)!r}: {err}") from None
    files = document.get("files", {})
    for fname, data in ((MODEL_FILE, model_bytes), (OPTIMIZER_FILE, opt_bytes)):
        if files.get(fname) != _sha256(data):
            raise CheckpointError(
                f"damaged checkpoint {str(step_dir)!r}: {fname} does not match its hash"
            )
    model_state = st_load(model_bytes)
    opt_tensors = st_load(opt_bytes)
    rng = {k[4:]: v for k, v in opt_tensors.items() if k.startswith("rng.")}
    opt_tensors = {k: v for k, v in opt_tensors.items() if k.startswith("state.")}
    optimizer_state = optimizer_state_from_parts(opt_tensors, document["optimizer"])
    return Checkpoint(step_dir, model_state, optimizer_state, rng, document)


def rng_state() -> dict[str, Tensor]:
    """The torch RNG states (CPU, and every CUDA device if CUDA is initialised)."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for n, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"cuda.{n}"] = s
    return states


def set_rng_state(states: dict[str, Tensor]) -> None:
    """Restore states from :func:`rng_state`."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    cuda = sorted((k for k in states if k.startswith("cuda.")), key=lambda k: int(k[5:]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([states[k] for k in cuda][: torch.cuda.device_count()])
