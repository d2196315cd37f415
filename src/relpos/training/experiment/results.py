"""Reading the results document of the K sweep (``results.json``): one run's evaluation at a
length, its accuracy by dependency distance, pooled over distances, and the runs of one
(task, depth). The report and the figures read the results through these."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["accuracy", "around_k", "both", "by_distance", "eval_at", "pooled", "runs_of"]


def eval_at(run: dict[str, Any], length: int) -> dict[str, Any] | None:
    """The evaluation of ``run`` at ``length`` (None if it was not evaluated there)."""
    for ev in run["eval"]:
        if ev["length"] == length:
            return ev
    return None


def accuracy(run: dict[str, Any], length: int) -> float:
    """Overall accuracy of ``run`` at ``length`` (nan if it was not evaluated there)."""
    ev = eval_at(run, length)
    return float("nan") if ev is None else float(ev["accuracy"])


def by_distance(run: dict[str, Any], length: int) -> dict[int, tuple[float, int]]:
    """Distance d -> (accuracy, scored positions) of ``run`` at ``length``."""
    ev = eval_at(run, length)
    if ev is None:
        return {}
    table = ev.get("by", {}).get("distance", {})
    return {int(d): (v["accuracy"], v["count"]) for d, v in table.items()}


def pooled(run: dict[str, Any], length: int, keep: Callable[[int], bool]) -> tuple[float, int]:
    """Accuracy pooled over the distances ``keep`` selects (nan if none)."""
    hits = total = 0.0
    for d, (acc, n) in by_distance(run, length).items():
        if keep(d):
            hits += acc * n
            total += n
    return (hits / total if total else float("nan")), int(total)


def around_k(run: dict[str, Any], length: int, k: int) -> list[tuple[float, int]]:
    """Pooled accuracy at d < K, d = K and d > K."""
    return [
        pooled(run, length, lambda d: d < k),
        pooled(run, length, lambda d: d == k),
        pooled(run, length, lambda d: d > k),
    ]


def both(runs: list[dict], first: str, second: str) -> tuple[dict, dict] | None:
    """The runs labelled ``first`` and ``second`` among ``runs`` (one (task, depth)), or None
    unless both are there."""
    labelled = {r["model_label"]: r for r in runs}
    if first in labelled and second in labelled:
        return labelled[first], labelled[second]
    return None


def runs_of(runs: list[dict], task: str, depth: int) -> list[dict]:
    """The runs of ``task`` and ``depth``, in sweep order."""
    return [r for r in runs if r["spec"]["task"] == task and r["spec"]["depth"] == depth]
