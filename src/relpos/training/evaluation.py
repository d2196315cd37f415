"""Scoring a model on a task: how a batch goes through the model (:func:`forward`: packed
when its rows have different lengths), the masked per-position statistics the training step
and the evaluation share, :func:`evaluate` (loss and accuracy at one length, by the task's
breakdown), and the lines that summarize a run's final evaluation."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos.training.tasks import Batch, Task

__all__ = ["evaluate", "forward", "masked_stats", "nats", "summarize"]


def forward(model: nn.Module, batch: Batch, *, pad: bool = False) -> tuple[Tensor, Batch]:
    """The model's logits on ``batch``, and the batch they line up with.

    A batch without ``key_mask`` (fixed-length rows) goes in as it is: ``model(ids)``. One
    with a ``key_mask`` is packed (:meth:`Batch.packed`): ``model(ids, cu_seqlens=cu)`` on
    the real tokens end to end, so no compute is spent on padding; with ``pad`` it goes in
    padded, ``model(ids, key_mask=key_mask)`` (to compare; the same numbers to float
    tolerance). A batch of no rows is always packed (an empty packed call; the models take
    no empty padded batch).

    Returns:
        ``(logits, scored)``: ``(B, L, V)`` logits and ``batch``, or packed ``(T, V)``
        logits and the packed batch of (T,) tensors.
    """
    if batch.key_mask is None:
        return model(batch.ids), batch
    if pad and len(batch):
        return model(batch.ids, key_mask=batch.key_mask), batch
    packed, cu_seqlens = batch.packed()
    return model(packed.ids, cu_seqlens=cu_seqlens), packed


def masked_stats(logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Per-position CE and correct (bool), shaped like ``batch.targets`` ((B, L), or (T,)
    packed), both only meaningful where ``batch.mask``, and that mask."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ce = F.cross_entropy(flat, batch.targets.reshape(-1), reduction="none")
    ce = ce.view_as(batch.targets)
    correct = logits.argmax(-1) == batch.targets
    return ce, correct, batch.mask


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Task,
    *,
    seed: int,
    length: int,
    eval_tokens: int = 16384,
    batch_tokens: int = 8192,
    device: torch.device | str = "cpu",
    pad: bool = False,
) -> dict[str, Any]:
    """Loss and accuracy on the eval split at one length, broken down by the task's meta.

    Args:
        model: maps ids (B, L) to logits (B, L, V) (and, for a task of variable-length
            rows, packed ids (T,) with ``cu_seqlens`` to (T, V); see :func:`forward`).
        task: the task.
        seed: the run's seed (the eval split is a separate stream of it).
        length: L, the sequence length (the longest row of a variable-length task).
        eval_tokens: evaluate ``ceil(eval_tokens / L)`` sequences (a variable-length task:
            that many times L tokens, its token budget).
        batch_tokens: sequences per forward pass ``max(1, batch_tokens // L)`` (the same
            budget).
        device: where the model lives.
        pad: run variable-length batches padded instead of packed (see :func:`forward`).

    Returns:
        ``{"length", "loss", "accuracy", "count", "by": {key: {value: {"accuracy",
        "count"}}}}`` (``by`` empty when the task has no breakdown).
    """
    was_training = model.training
    model.eval()
    sequences = max(1, math.ceil(eval_tokens / length))
    per_batch = max(1, batch_tokens // length)
    loss_sum = 0.0
    correct_sum = 0
    count = 0
    by: dict[int, list[int]] = {}
    key = task.breakdown
    for index, start in enumerate(range(0, sequences, per_batch)):
        size = min(per_batch, sequences - start)
        batch = task.batch(seed=seed, step=index, batch_size=size, length=length, split="eval").to(
            device
        )
        logits, scored = forward(model, batch, pad=pad)
        ce, correct, mask = masked_stats(logits, scored)
        loss_sum += float(ce[mask].double().sum())
        correct_sum += int(correct[mask].sum())
        count += int(mask.sum())
        if key is not None:
            values = scored.meta[key][mask].tolist()
            hits = correct[mask].tolist()
            for v, h in zip(values, hits, strict=True):
                slot = by.setdefault(int(v), [0, 0])
                slot[0] += int(h)
                slot[1] += 1
    model.train(was_training)
    result: dict[str, Any] = {
        "length": length,
        "loss": loss_sum / max(count, 1),
        "accuracy": correct_sum / max(count, 1),
        "count": count,
        "by": {},
    }
    if key is not None:
        result["by"][key] = {
            str(v): {"accuracy": c / n, "count": n} for v, (c, n) in sorted(by.items())
        }
    return result


def nats(loss: float) -> str:
    """A cross-entropy with its unit: nats, and bits beside."""
    return f"{loss:.4f} nats ({loss / math.log(2):.4f} bits)"


def summarize(metrics: dict[str, Any]) -> list[str]:
    """Human-readable lines for the final evaluation (losses in nats per scored position,
    bits beside)."""
    lines = []
    for ev in metrics.get("eval", []):
        lines.append(
            f"length {ev['length']:>5}: loss {nats(ev['loss'])}  accuracy {ev['accuracy']:.4f}  "
            f"({ev['count']} scored positions)"
        )
        for key, table in ev.get("by", {}).items():
            cells = "  ".join(f"{k}:{v['accuracy']:.2f}" for k, v in table.items())
            lines.append(f"    by {key}: {cells}")
    return lines
