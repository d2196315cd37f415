"""Evaluating a model of the K sweep: bits per character and closing-bracket accuracy of a
``pysrc`` model (:func:`evaluate_code`; the synthetic tasks are evaluated by the trainer),
and the accuracy of guessing on a synthetic task (:func:`chance`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from relpos.training.experiment.results import BUCKETS, SEED_RANGE
from relpos.training.tasks import Task

__all__ = ["EVAL_SEED", "bucket_label", "chance", "evaluate_code"]

#: The code models are all evaluated on the same validation windows (this stream), so
#: seeds differ only in training and two models compare on identical characters.
EVAL_SEED = 0


def bucket_label(low: int, high: int) -> str:
    """The key of an opener-distance bucket in a record's ``brackets``: ``"17-32"``."""
    return f"{low}-{high}"


@torch.no_grad()
def evaluate_code(
    model: torch.nn.Module, task: Task, *, seed: int, length: int, eval_tokens: int,
    batch_tokens: int = 8192,
) -> dict[str, Any]:
    """Bits per character and closing-bracket accuracy of a code model at one length.

    Returns:
        ``{"length", "bpc", "bpc_sd", "bpc_per_sequence", "sequences", "characters",
        "brackets"}``: ``bpc`` the mean over all scored characters, ``bpc_sd`` the standard
        deviation of the sequences' means (listed, 4 digits, in ``bpc_per_sequence``, so
        two models evaluated on the same windows can be compared sequence by sequence);
        ``brackets`` maps an opener-distance bucket ``"lo-hi"`` (and the
        claims' ``"10-20"``) to ``{"count", "hits", "type_hits"}``: closers whose opener is
        in the window, how many the model predicts exactly (argmax over all characters),
        and how many it ranks above the other two closers (the bracket type).
    """
    from relpos.training.experiment.corpus import closer_ids

    was_training = model.training
    model.eval()
    sequences = max(1, math.ceil(eval_tokens / length))
    per_batch = max(1, batch_tokens // length)
    closers = closer_ids()
    seq_bpc: list[float] = []
    total = 0.0
    chars = 0
    ranges = [*BUCKETS, SEED_RANGE]
    tallies = {bucket_label(*r): [0, 0, 0] for r in ranges}
    for index, start in enumerate(range(0, sequences, per_batch)):
        size = min(per_batch, sequences - start)
        batch = task.batch(seed=seed, step=index, batch_size=size, length=length, split="eval")
        logits = model(batch.ids).float()  # (B, L, V)
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.targets.flatten(), reduction="none"
        ).view_as(batch.targets).double()  # (B, L)
        bits = ce / math.log(2)
        seq_bpc += bits.mean(1).tolist()
        total += float(bits.sum())
        chars += bits.numel()
        dist = batch.meta["distance"]
        scored = dist > 0
        if not bool(scored.any()):
            continue
        d = dist[scored]
        target = batch.targets[scored]
        picked = logits[scored]  # (N, V)
        hit = picked.argmax(-1) == target
        among = closers[picked[:, closers].argmax(-1)]
        type_hit = among == target
        for low, high in ranges:
            inside = (d >= low) & (d <= high)
            t = tallies[bucket_label(low, high)]
            t[0] += int(inside.sum())
            t[1] += int((hit & inside).sum())
            t[2] += int((type_hit & inside).sum())
    model.train(was_training)
    mean = total / max(chars, 1)
    sd = (math.sqrt(sum((b - sum(seq_bpc) / len(seq_bpc)) ** 2 for b in seq_bpc)
                    / (len(seq_bpc) - 1)) if len(seq_bpc) > 1 else math.nan)
    return {
        "length": length,
        "bpc": mean,
        "bpc_sd": sd,
        "bpc_per_sequence": [float(f"{b:.4g}") for b in seq_bpc],
        "sequences": len(seq_bpc),
        "characters": chars,
        "brackets": {k: {"count": c, "hits": h, "type_hits": th}
                     for k, (c, h, th) in tallies.items() if c},
    }


def chance(task: Task) -> float:
    """The accuracy of guessing on a synthetic task (NaN for ``pysrc``)."""
    if task.name == "recall":
        return 1.0 / task.num_symbols  # type: ignore[attr-defined]
    if task.name == "agree":
        return 0.5
    return float("nan")
