"""Reading the results document of the K sweep (``results.json.gz``: gzip-compressed JSON;
sweeps before it wrote plain ``results.json``, which :func:`load_results` reads as well).

Runs are grouped into *configurations* (task, depth, model label), each with one run per
seed; the helpers return, per seed, ``(hits, count)`` for accuracies and
``(mean, sd, n)`` for bits per character, which :mod:`~relpos.training.experiment.stats`
turns into means and intervals. The report and the figures read the results through these.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relpos.training.experiment.stats import Interval, accuracy_interval, mean_interval

__all__ = [
    "AGREE_LONG",
    "BPC_SMALL",
    "BUCKETS",
    "CODE_LONG",
    "PLATEAU_PP",
    "SEED_RANGE",
    "accuracy",
    "bpc_interval",
    "bracket_counts",
    "budget_of",
    "by_distance",
    "configurations",
    "curves",
    "eval_at",
    "eval_lengths",
    "is_curve_run",
    "label_of",
    "load_results",
    "overall_counts",
    "pooled_counts",
    "runs_of",
    "signal_groups",
    "train_length",
]

#: Opener-distance buckets of the closing-bracket targets of ``pysrc``, and the claims'
#: 10-20 range (tallied on its own).
BUCKETS: tuple[tuple[int, int], ...] = (
    (1, 4), (5, 16), (17, 32), (33, 64), (65, 128), (129, 512), (513, 2048))
SEED_RANGE = (10, 20)
CODE = "pysrc"
#: A difference in bits per character below this is "small".
BPC_SMALL = 0.02
#: Code closers with the opener this far back or more are "long-range" (claim 4 on code).
CODE_LONG = 17
#: Synthetic dependencies this far back or more are "long-range" (claim 4, and the curves).
AGREE_LONG = 5
#: A metric "plateaued" when every curve seed moved less than this over the last doubling
#: of the budget (pp of accuracy; bits per character: BPC_SMALL).
PLATEAU_PP = 2.0


#: The results document in an experiment's directory, and the name sweeps wrote it under
#: before it was compressed (read, never written).
RESULTS_FILE = "results.json.gz"
LEGACY_RESULTS_FILE = "results.json"


def results_path(out_dir: str | os.PathLike[str]) -> Path | None:
    """The results document of the experiment in ``out_dir`` (``results.json.gz``, else a
    plain ``results.json``), or None if it holds neither."""
    for name in (RESULTS_FILE, LEGACY_RESULTS_FILE):
        if (Path(out_dir) / name).is_file():
            return Path(out_dir) / name
    return None


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The results document at ``path``: an experiment's directory, its ``results.json.gz``
    or a plain ``results.json`` (told apart by content, not by name).

    Raises:
        FileNotFoundError: if ``path`` is a directory without a results document.
        ValueError: if the file is not a (gzip-compressed) JSON object.
    """
    where = Path(path)
    if where.is_dir():
        found = results_path(where)
        if found is None:
            raise FileNotFoundError(
                f"{str(where)!r} holds no results document ({RESULTS_FILE} or "
                f"{LEGACY_RESULTS_FILE})")
        where = found
    data = where.read_bytes()
    try:
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        document = json.loads(data)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{str(where)!r} is not a results document: {e}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{str(where)!r} is not a results document: it holds a JSON "
                         f"{type(document).__name__}, not an object")
    return document


def results_bytes(document: dict[str, Any]) -> bytes:
    """``document`` as the bytes of ``results.json.gz``: one line of JSON, gzip-compressed
    with no time stamp (the same document gives the same bytes)."""
    return gzip.compress((json.dumps(document) + "\n").encode(), compresslevel=9, mtime=0)


def label_of(run: dict[str, Any]) -> str:
    return str(run["model_label"])


def eval_at(run: dict[str, Any], length: int) -> dict[str, Any] | None:
    """The evaluation of ``run`` at ``length`` (None if it was not evaluated there)."""
    for ev in run["eval"]:
        if ev["length"] == length:
            return ev
    return None


def accuracy(run: dict[str, Any], length: int) -> float:
    """Overall accuracy of a synthetic ``run`` at ``length`` (nan if not evaluated there)."""
    ev = eval_at(run, length)
    return float("nan") if ev is None else float(ev["accuracy"])


def by_distance(run: dict[str, Any], length: int) -> dict[int, tuple[int, int]]:
    """Distance d -> (hits, scored positions) of a synthetic ``run`` at ``length``."""
    ev = eval_at(run, length)
    if ev is None:
        return {}
    table = ev.get("by", {}).get("distance", {})
    return {int(d): (round(v["accuracy"] * v["count"]), int(v["count"]))
            for d, v in table.items()}


def overall_counts(run: dict[str, Any], length: int) -> tuple[int, int]:
    """(hits, scored positions) over all distances of a synthetic run."""
    ev = eval_at(run, length)
    if ev is None:
        return 0, 0
    return round(ev["accuracy"] * ev["count"]), int(ev["count"])


def pooled_counts(run: dict[str, Any], length: int, keep: Callable[[int], bool]
                  ) -> tuple[int, int]:
    """(hits, count) pooled over the distances ``keep`` selects (synthetic runs)."""
    hits = total = 0
    for d, (h, n) in by_distance(run, length).items():
        if keep(d):
            hits += h
            total += n
    return hits, total


def bracket_counts(run: dict[str, Any], length: int, bucket: str, *, kind: str = "hits"
                   ) -> tuple[int, int]:
    """(hits, count) of the closing brackets of a code run at ``length`` whose opener is in
    ``bucket`` (``"17-32"``, or ``"10-20"``); ``kind="type_hits"`` for the bracket type."""
    ev = eval_at(run, length)
    if ev is None:
        return 0, 0
    cell = ev.get("brackets", {}).get(bucket)
    if not cell:
        return 0, 0
    return int(cell[kind]), int(cell["count"])


def bpc_interval(group: list[dict[str, Any]], length: int) -> Interval:
    """Mean bits per character over the seeds of one configuration at ``length``: the wider
    of the t interval over seeds and the mean of the seeds' interval over sequences."""
    values, halves = [], []
    for run in group:
        ev = eval_at(run, length)
        if ev is None:
            continue
        values.append(float(ev["bpc"]))
        sd, n = ev.get("bpc_sd", math.nan), ev.get("sequences", 0)
        if n > 1 and not math.isnan(sd):
            # Over all seeds' sequences: the seeds' mean has sd / sqrt(n * seeds).
            halves.append(1.959963984540054 * sd / math.sqrt(n))
    data_half = (sum(halves) / len(halves) / math.sqrt(len(halves))) if halves else 0.0
    return mean_interval(values, data_half=data_half)


def budget_of(run: dict[str, Any]) -> int:
    """The training steps of ``run``."""
    return int(run["train"]["steps"])


def is_curve_run(run: dict[str, Any]) -> bool:
    """Whether ``run`` is a learning-curve run (trained at a budget other than the
    sweep's)."""
    return bool(run["spec"].get("steps", 0))


def runs_of(runs: list[dict], task: str, depth: int | None = None) -> list[dict]:
    """The sweep's runs of ``task`` (and ``depth``), in sweep order (learning-curve runs
    left out: see :func:`curves`)."""
    return [r for r in runs if r["spec"]["task"] == task and not is_curve_run(r)
            and (depth is None or r["spec"]["depth"] == depth)]


def curves(runs: list[dict], task: str, depth: int) -> dict[str, dict[int, list[dict]]]:
    """Model label -> step budget -> its runs (sorted by seed) for the learning curves of
    ``task`` at ``depth``: the curve runs and, for the same models and seeds, the sweep's
    own runs at the sweep's budget. Empty when the sweep trained no curve."""
    points = [r for r in runs if r["spec"]["task"] == task and r["spec"]["depth"] == depth]
    curve = [r for r in points if is_curve_run(r)]
    if not curve:
        return {}
    labels = {label_of(r) for r in curve}
    seeds = {r["spec"].get("seed", 0) for r in curve}
    out: dict[str, dict[int, list[dict]]] = {}
    for r in points:
        if label_of(r) in labels and r["spec"].get("seed", 0) in seeds:
            out.setdefault(label_of(r), {}).setdefault(budget_of(r), []).append(r)
    for by_budget in out.values():
        for group in by_budget.values():
            group.sort(key=lambda r: r["spec"].get("seed", 0))
    ordered = sorted(out, key=lambda lab: (not lab.startswith("K="),
                                           int(lab[2:]) if lab.startswith("K=") else 0))
    return {lab: dict(sorted(out[lab].items())) for lab in ordered}


def configurations(runs: list[dict]) -> dict[str, list[dict]]:
    """Model label -> its runs (one per seed, sorted by seed), in the order labels first
    appear; ``runs`` are those of one (task, depth)."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(label_of(r), []).append(r)
    for group in out.values():
        group.sort(key=lambda r: r["spec"].get("seed", 0))
    return out


def seed_accuracy(group: list[dict], counts: Callable[[dict], tuple[int, int]]) -> Interval:
    """The accuracy interval of one configuration, ``counts(run)`` per seed."""
    return accuracy_interval([counts(r) for r in group])


def train_length(results: dict[str, Any], task: str) -> int:
    """The training length of ``task`` in the sweep of ``results``."""
    cfg = results["config"]
    return int(cfg["code_train_length"] if task == CODE else cfg["train_length"])


def depths(results: dict[str, Any], task: str) -> list[int]:
    """The depths ``task`` was trained at."""
    cfg = results["config"]
    return [cfg["code_depth"]] if task == CODE else list(cfg["depths"])


def eval_lengths(results: dict[str, Any], task: str) -> list[int]:
    """The lengths ``task`` was evaluated at (``pysrc``: its training length times each of
    ``code_eval_factors``)."""
    cfg = results["config"]
    if task == CODE:
        return [cfg["code_train_length"] * f for f in cfg["code_eval_factors"]]
    return list(cfg["eval_lengths"])


def signal_groups(results: dict[str, Any]) -> dict[str, list[dict]]:
    """The ``pysrc`` runs that recorded the training signal of each table row, by model (see
    :func:`configurations`; empty when none did)."""
    return configurations([r for r in runs_of(results["runs"], CODE) if "signal" in r])


def code_counts(n: int, low: int, high: int) -> Callable[[dict], tuple[int, int]]:
    """Closing brackets with the opener ``low..high`` back, at length ``n``: the claims'
    ``10-20`` range, or the buckets of :data:`BUCKETS` that lie inside it (pooled)."""
    if (low, high) == SEED_RANGE:
        labels = [f"{low}-{high}"]
    else:
        labels = [f"{lo}-{hi}" for lo, hi in BUCKETS if lo >= low and hi <= high and lo < n]

    def counts(r: dict) -> tuple[int, int]:
        cells = [bracket_counts(r, n, label) for label in labels]
        return sum(c[0] for c in cells), sum(c[1] for c in cells)

    return counts


def curve_metrics(results: dict[str, Any], task: str
                  ) -> list[tuple[str, Callable[[dict], float], float, str]]:
    """The learning-curve metrics of ``task``: (name, value of a run, plateau threshold,
    unit)."""
    n = train_length(results, task)
    if task == CODE:
        counts = code_counts(n, CODE_LONG, n)

        def bpc(r: dict) -> float:
            ev = eval_at(r, n)
            return math.nan if ev is None else float(ev["bpc"])

        def brackets(r: dict) -> float:
            h, c = counts(r)
            return h / c if c else math.nan

        return [(f"bits/char at length {n} (overall)", bpc, BPC_SMALL, "bits"),
                (f"closing-bracket accuracy, d={CODE_LONG}-{n} (subset)", brackets,
                 PLATEAU_PP / 100, "pp")]

    def overall(r: dict) -> float:
        h, c = overall_counts(r, n)
        return h / c if c else math.nan

    def far(r: dict) -> float:
        h, c = pooled_counts(r, n, lambda d: d >= AGREE_LONG)
        return h / c if c else math.nan

    return [(f"accuracy at length {n} (overall)", overall, PLATEAU_PP / 100, "pp"),
            (f"accuracy, d>={AGREE_LONG} (subset)", far, PLATEAU_PP / 100, "pp")]
