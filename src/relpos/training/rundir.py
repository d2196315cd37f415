"""A run's output directory: its layout (``checkpoints/`` and ``metrics.json``), what an
earlier run left there (:func:`previous_run`, :func:`clear_run`), and claiming it for a new
run (:func:`prepare_out_dir`: refused while it holds a run, unless that run is resumed or
replaced)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from relpos.training.checkpoint import MANIFEST

__all__ = [
    "CHECKPOINT_DIR",
    "METRICS_FILE",
    "clear_run",
    "load_metrics",
    "prepare_out_dir",
    "previous_run",
]

METRICS_FILE = "metrics.json"
CHECKPOINT_DIR = "checkpoints"


def previous_run(out_dir: str | Path) -> list[Path]:
    """What a run left in ``out_dir``: its ``checkpoints/`` (if not empty) and
    ``metrics.json``, those present."""
    out = Path(out_dir)
    found = []
    ckpt = out / CHECKPOINT_DIR
    if ckpt.exists() and not (ckpt.is_dir() and not any(ckpt.iterdir())):
        found.append(ckpt)
    if (out / METRICS_FILE).exists():
        found.append(out / METRICS_FILE)
    return found


def _ours(name: str) -> bool:
    """Whether a name in ``checkpoints/`` is one :func:`save_checkpoint` writes."""
    return name == MANIFEST or name.startswith(("step-", ".tmp-")) or (
        name.startswith(".") and name.endswith(".tmp")
    )


def clear_run(out_dir: str | Path) -> list[Path]:
    """Remove what a run left in ``out_dir`` (see :func:`previous_run`); returns it.

    Raises:
        ValueError: if ``checkpoints/`` holds anything a run does not write (nothing is
            removed then).
    """
    found = previous_run(out_dir)
    for path in found:
        if path.name == CHECKPOINT_DIR:
            if not path.is_dir():
                raise ValueError(f"{str(path)!r} is not a checkpoint directory; remove it")
            foreign = sorted(p.name for p in path.iterdir() if not _ours(p.name))
            if foreign:
                raise ValueError(
                    f"{str(path)!r} holds files relpos train does not write "
                    f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                    "remove them or choose another output directory"
                )
        elif path.is_dir():
            raise ValueError(f"{str(path)!r} is a directory, not a metrics file; remove it")
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found



def prepare_out_dir(
    out_dir: str | Path | None, *, is_main: bool, resume: bool, overwrite: bool
) -> Path | None:
    """``out_dir`` as a path (None: no files), refused or cleared (rank 0) for a new run.

    Raises:
        ValueError: if it holds a run (see :func:`previous_run`) and neither ``resume`` nor
            ``overwrite`` is given, or if :func:`clear_run` refuses to clear it.
    """
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and is_main and not resume:
        found = previous_run(out)
        if found and not overwrite:
            raise ValueError(
                f"{str(out)!r} already holds a run ({', '.join(p.name for p in found)}); "
                "resume=True continues it, overwrite=True replaces it"
            )
        if found:
            clear_run(out)
    return out


def load_metrics(out_dir: str | Path) -> dict[str, Any]:
    """Read ``out_dir/metrics.json``."""
    return json.loads((Path(out_dir) / METRICS_FILE).read_text())

