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

Reading checks the structure of everything it reads (the manifest, ``state.json``, both
safetensors files, the RNG states) and raises :class:`CheckpointError` naming the file and
what is wrong; :func:`check_model_state` and :func:`check_optimizer_state` compare the
tensors with the model and optimizer they are about to be loaded into.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
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
    "check_model_state",
    "check_optimizer_state",
    "load_checkpoint",
    "optimizer_state_from_parts",
    "optimizer_state_to_parts",
    "read_state",
    "save_checkpoint",
    "text_vocabulary",
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
    # One order whatever order the file's tensors came back in (parameters by index, each
    # one's entries by name), so that every process holds the same dict.
    state = {i: dict(sorted(state[i].items())) for i in sorted(state)}
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


def _damaged(where: Path, detail: str) -> CheckpointError:
    return CheckpointError(f"damaged checkpoint {str(where)!r}: {detail}")


def _is_int(value: object, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _step_dir(root: Path) -> Path:
    """The step directory ``latest.json`` names."""
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"no checkpoint in {str(root)!r} (missing {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"damaged checkpoint manifest {str(manifest_path)!r}: {err}"
        ) from None
    if isinstance(manifest, dict) and manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(root)!r} has format version {manifest.get('format_version')!r}; "
            f"this relpos reads version {FORMAT_VERSION}"
        )
    name = manifest.get("checkpoint") if isinstance(manifest, dict) else None
    if not isinstance(name, str) or not name.startswith("step-") or Path(name).name != name:
        raise CheckpointError(
            f"damaged checkpoint manifest {str(manifest_path)!r}: expected "
            f'{{"format_version": {FORMAT_VERSION}, "checkpoint": "step-..."}}, got '
            f"{_short(manifest)}"
        )
    return root / name


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_document(document: object, step_dir: Path) -> dict[str, Any]:
    """``state.json`` after checking the entries every checkpoint has."""
    where = step_dir / STATE_FILE
    if not isinstance(document, dict):
        raise _damaged(where, f"expected a JSON object, got a {type(document).__name__}")
    if document.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} has format version "
            f"{document.get('format_version')!r}; this relpos reads version {FORMAT_VERSION}"
        )
    missing = [k for k in ("step", "optimizer", "files") if k not in document]
    if missing:
        raise _damaged(where, f"missing {', '.join(map(repr, missing))}")
    if not _is_int(document["step"]):
        raise _damaged(where, f"'step' must be an int >= 0, got {_short(document['step'])}")
    files = document["files"]
    if not isinstance(files, dict) or any(
        not isinstance(files.get(name), str) for name in (MODEL_FILE, OPTIMIZER_FILE)
    ):
        raise _damaged(
            where, f"'files' must map {MODEL_FILE} and {OPTIMIZER_FILE} to their sha256, got "
            f"{_short(files)}"
        )
    optimizer = document["optimizer"]
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list)
        and all(_is_int(i) for i in g["params"])
        for g in groups
    ):
        raise _damaged(
            where, "'optimizer' must hold 'param_groups', a list of objects with 'params' "
            f"(lists of ints), got {_short(optimizer)}"
        )
    scalars = optimizer.get("scalars", {})
    if not isinstance(scalars, dict) or not all(
        isinstance(k, str) and k.isdigit() and isinstance(v, dict) for k, v in scalars.items()
    ):
        raise _damaged(where, f"'optimizer.scalars' is malformed: {_short(scalars)}")
    return document


def read_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``state.json`` document of the checkpoint ``latest.json`` names (no tensors read).

    Raises:
        CheckpointError: as :func:`load_checkpoint`, for the manifest and ``state.json``.
    """
    return _read_document(_step_dir(Path(directory)))


def text_vocabulary(directory: str | os.PathLike[str]) -> str | None:
    """The characters of a ``relpos train --text`` checkpoint (token ``i`` = ``chars[i]``),
    or None for a checkpoint of another task.

    Args:
        directory: a checkpoint directory (the one holding ``latest.json``).

    Raises:
        CheckpointError: if it holds no readable checkpoint.
    """
    task = read_state(directory).get("task")
    if isinstance(task, dict) and task.get("name") == "text":
        chars = task.get("chars")
        if isinstance(chars, str) and chars:
            return chars
    return None


def _read_document(step_dir: Path) -> dict[str, Any]:
    try:
        document = json.loads((step_dir / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise _damaged(step_dir, str(err)) from None
    return _check_document(document, step_dir)


def _tensors(data: bytes, where: Path) -> dict[str, Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError, OSError) as err:
        raise _damaged(where, f"not a readable safetensors file ({err})") from None


def _check_rng(name: str, tensor: Tensor, where: Path) -> None:
    if name != "torch" and not (name.startswith("cuda.") and name[5:].isdigit()):
        raise _damaged(where, f"unknown RNG state 'rng.{name}'; allowed: rng.torch, rng.cuda.<n>")
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise _damaged(
            where, f"RNG state 'rng.{name}' must be a 1-D uint8 tensor, got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    if name == "torch" and tensor.numel() != torch.get_rng_state().numel():
        raise _damaged(
            where, f"RNG state 'rng.torch' has {tensor.numel()} bytes; torch's has "
            f"{torch.get_rng_state().numel()}"
        )


def load_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    """Read the checkpoint ``latest.json`` names, verifying format, hashes and structure.

    Raises:
        CheckpointError: if there is no checkpoint, its format version is unknown, a file
            is missing, does not match its recorded hash or is malformed (``state.json``
            not an object or without ``step``/``optimizer``/``files``, a safetensors file
            that does not parse, optimizer tensors that do not belong to the recorded
            parameters, an RNG state that is not torch's).
    """
    step_dir = _step_dir(Path(directory))
    document = _read_document(step_dir)
    try:
        model_bytes = (step_dir / MODEL_FILE).read_bytes()
        opt_bytes = (step_dir / OPTIMIZER_FILE).read_bytes()
    except OSError as err:
        raise _damaged(step_dir, str(err)) from None
    files = document["files"]
    for fname, data in ((MODEL_FILE, model_bytes), (OPTIMIZER_FILE, opt_bytes)):
        if files[fname] != _sha256(data):
            raise _damaged(step_dir, f"{fname} does not match its hash")
    model_state = _tensors(model_bytes, step_dir / MODEL_FILE)
    opt_tensors = _tensors(opt_bytes, step_dir / OPTIMIZER_FILE)
    ids = {i for g in document["optimizer"]["param_groups"] for i in g["params"]}
    rng: dict[str, Tensor] = {}
    state_tensors: dict[str, Tensor] = {}
    for key, value in opt_tensors.items():
        if key.startswith("rng."):
            _check_rng(key[4:], value, step_dir / OPTIMIZER_FILE)
            rng[key[4:]] = value
            continue
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() or (
            int(parts[1]) not in ids
        ):
            raise _damaged(
                step_dir / OPTIMIZER_FILE,
                f"unexpected tensor {key!r}; allowed: state.<parameter>.<name> for the "
                f"{len(ids)} recorded parameters, rng.torch, rng.cuda.<n>",
            )
        state_tensors[key] = value
    for index in document["optimizer"].get("scalars", {}):
        if int(index) not in ids:
            raise _damaged(
                step_dir / STATE_FILE, f"optimizer state of unknown parameter {index}"
            )
    optimizer_state = optimizer_state_from_parts(state_tensors, document["optimizer"])
    return Checkpoint(step_dir, model_state, optimizer_state, rng, document)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_model_state(checkpoint: Checkpoint, expected: Mapping[str, Tensor]) -> None:
    """Check that the checkpoint's weights fit a model whose ``state_dict()`` is
    ``expected``: the same names, shapes and dtypes.

    Raises:
        CheckpointError: naming the first names that differ.
    """
    where = checkpoint.path / MODEL_FILE
    saved = checkpoint.model_state
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(map(repr, missing[:3]))}"
                         + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
        if unexpected:
            parts.append(f"unexpected {', '.join(map(repr, unexpected[:3]))}"
                         + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""))
        raise _damaged(where, "its weights do not fit the model: " + "; ".join(parts))
    for name, want in expected.items():
        got = saved[name]
        if _shape(got) != _shape(want) or got.dtype != want.dtype:
            raise _damaged(
                where, f"weight {name!r} is {got.dtype} of shape {_shape(got)}; the model "
                f"has {want.dtype} of shape {_shape(want)}"
            )


def check_optimizer_state(checkpoint: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
    """Check that the checkpoint's optimizer state fits ``optimizer``: as many parameter
    groups of the same sizes, and per-parameter tensors of the parameter's shape (0-d or
    one-element ``step`` counters).

    Raises:
        CheckpointError: naming the first entry that does not fit.
    """
    where = checkpoint.path / OPTIMIZER_FILE
    groups = checkpoint.optimizer_state["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    want_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != want_sizes:
        raise _damaged(
            checkpoint.path / STATE_FILE,
            f"the optimizer has parameter groups of sizes {sizes}; the model's are {want_sizes}",
        )
    params = {
        saved: param
        for g, mine in zip(groups, optimizer.param_groups, strict=True)
        for saved, param in zip(g["params"], mine["params"], strict=True)
    }
    for index, entries in checkpoint.optimizer_state["state"].items():
        param = params.get(index)
        if param is None:
            raise _damaged(where, f"optimizer state of unknown parameter {index}")
        for name, value in entries.items():
            if not isinstance(value, Tensor):
                continue
            if name == "step":
                ok = value.numel() == 1
                want = "one element"
            else:
                ok = _shape(value) == _shape(param) and value.is_floating_point()
                want = f"a float tensor of shape {_shape(param)}, as its parameter"
            if not ok:
                raise _damaged(
                    where, f"optimizer state {name!r} of parameter {index} is {value.dtype} "
                    f"of shape {_shape(value)}; expected {want}"
                )


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
