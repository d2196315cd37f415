"""Synthetic tasks (and character-level text) for studying the clip distance K.

Every task generates batches on the fly, deterministically: the batch for
``(seed, split, step, length)`` is always the same, whatever ran before it, so a resumed
or distributed run sees exactly the data of an uninterrupted single-process run.

A :class:`Batch` holds ``ids`` (B, L), ``targets`` (B, L), a loss ``mask`` (B, L) (True =
this position is scored) and ``meta``: named (B, L) integer tensors describing each scored
position (for example the dependency distance ``d``), ``-1`` where not applicable, so
accuracy can be broken down by distance. A task of variable-length examples
(:attr:`Task.variable_length`: ``TextLM(unit="line")``) pads its rows on the right to the
batch's longest and adds ``key_mask`` (B, L) (True = real token); the trainer packs such a
batch (:meth:`Batch.packed`), so no compute is spent on the padding.

Tasks:

* :class:`OffsetRecall` (``recall``): random symbols; at a few positions a *probe* token
  ``P_d`` (one per distance ``d``) asks for the symbol exactly ``d`` positions back. The
  symbols are uniform and independent, so content gives no hint: only the offset does.
* :class:`Agreement` (``agree``): clauses "``SUBJ`` noun ... ``VERB``" where the verb must
  agree in number (``SG``/``PL``) with the most recent marked subject, ``d`` tokens back;
  unmarked nouns of random number (attractors) and fillers lie in between, and an earlier
  marked subject always competes, so the nearest one must be found.
* :class:`SortWindows` (``sort``): windows of ``w`` symbols, a separator, then the same
  symbols sorted (next-token prediction of the sorted part). The rule does not depend on
  the sequence length: a test of length generalisation.
* :class:`TextLM` (``text``): next-character prediction on a user's UTF-8 text file, with
  a train/validation split; examples are fixed-length windows (``unit="window"``) or lines
  (``unit="line"``: variable-length rows, batched by a token budget).

The package: ``base`` (:class:`Batch`, :class:`Task`), ``synthetic`` (recall, agree, sort),
``text`` (:class:`TextLM`); this module builds a task by name or from its config.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relpos.training.tasks.base import SPLITS, Batch, Task, _check_int, _stream_seed
from relpos.training.tasks.synthetic import (
    DEFAULT_AGREE_DISTANCES,
    DEFAULT_RECALL_DISTANCES,
    Agreement,
    OffsetRecall,
    SortWindows,
)
from relpos.training.tasks.text import TEXT_UNITS, TextLM, _line_spans

__all__ = [
    "SPLITS",
    "TASKS",
    "TEXT_UNITS",
    "Agreement",
    "Batch",
    "OffsetRecall",
    "SortWindows",
    "Task",
    "TextLM",
    "build_task",
    "task_from_config",
]

#: Private helpers other modules of the lab use (the corpus task's seeds and checks).
_SHARED = (_check_int, _stream_seed, _line_spans)


#: Task names accepted by ``--task`` and :func:`build_task`.
TASKS = ("recall", "agree", "sort", "text")


def build_task(
    name: str,
    *,
    distances: Sequence[int] | None = None,
    text: str | Path | None = None,
    num_symbols: int | None = None,
    window: int | None = None,
    unit: str | None = None,
) -> Task:
    """Build a task by name (the ``--task`` choices).

    Args:
        name: one of :data:`TASKS`.
        distances: dependency distances for ``recall``/``agree`` (default: the task's).
        text: the text file of ``text``.
        num_symbols: symbol alphabet of ``recall``/``sort``.
        window: window size of ``sort``.
        unit: the example unit of ``text`` (:data:`TEXT_UNITS`; default ``"window"``;
            ``--lines`` is ``"line"``).

    Raises:
        ValueError: on an unknown name or a missing/unexpected option.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}")
    if name == "text":
        if text is None:
            raise ValueError("task 'text' needs a text file (--text FILE)")
        return TextLM(text) if unit is None else TextLM(text, unit=unit)
    if text is not None:
        raise ValueError(f"--text FILE is for task 'text', not {name!r}")
    if unit is not None:
        raise ValueError(f"unit {unit!r} (--lines) is for task 'text' (--text FILE), not "
                         f"{name!r}")
    if name == "recall":
        kw: dict[str, Any] = {} if num_symbols is None else {"num_symbols": num_symbols}
        return OffsetRecall(distances or DEFAULT_RECALL_DISTANCES, **kw)
    if name == "agree":
        return Agreement(distances or DEFAULT_AGREE_DISTANCES)
    kw = {} if num_symbols is None else {"num_symbols": num_symbols}
    if window is not None:
        kw["window"] = window
    return SortWindows(**kw)


def task_from_config(config: dict[str, Any]) -> Task:
    """Rebuild a task from :meth:`Task.config`.

    Raises:
        ValueError: if the config names an unknown task, or (``text``) the file's
            characters changed since the config was written.
    """
    params = dict(config)
    name = params.pop("name", None)
    if name == "recall":
        return OffsetRecall(**params)
    if name == "agree":
        return Agreement(**params)
    if name == "sort":
        return SortWindows(**params)
    if name == "text":
        chars = params.pop("chars", None)
        task = TextLM(**params)
        if chars is not None and "".join(task.chars) != chars:
            raise ValueError(
                f"text file {params.get('path')!r} has changed: its characters differ from "
                "those the checkpoint was trained on"
            )
        return task
    raise ValueError(f"unknown task {name!r} in config; allowed: {', '.join(TASKS)}")
