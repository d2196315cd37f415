"""What the numbers of the K sweep say: the claims of the handbook section on clipped
relative positions (Shaw et al., 2018) with their verdicts
(:func:`claims`, :func:`signal_claims`), and which K to choose per dependency distance
(:func:`guidance`).

Numbers are means over seeds with 95% intervals (:mod:`~relpos.training.experiment.stats`);
a verdict is "yes" or "no" only when its interval lies on one side of the claim's threshold,
"inconclusive" otherwise. A claim is judged against the *reference* model of a task: the
largest K not above its training length, so every offset seen in training has its own row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from relpos.training.experiment.formatting import bits, kstr, over, pct, pp
from relpos.training.experiment.results import (
    AGREE_LONG,
    BPC_SMALL,
    BUCKETS,
    CODE,
    CODE_LONG,
    by_distance,
    code_counts,
    configurations,
    depths,
    eval_at,
    eval_lengths,
    overall_counts,
    pooled_counts,
    runs_of,
    signal_groups,
    train_length,
)
from relpos.training.experiment.stats import (
    Interval,
    accuracy_interval,
    difference_interval,
    mean_interval,
    verdict_above,
    verdict_below,
    verdict_within,
)

__all__ = [
    "FLOOR",
    "NOT_LEARNED",
    "SMALL_PP",
    "Counts",
    "claims",
    "guidance",
    "guidance_rows",
    "signal_claims",
    "undecided_ks",
]


#: A difference in accuracy below this (percentage points) is "small"; a K is "enough" when
#: it is shown to be within it of the reference. Stated in the report.
SMALL_PP = 2.0
#: A subset on which no compared model's interval reaches this accuracy was not learned:
#: its comparisons say nothing about K.
FLOOR = 0.10


def _k_of(label: str) -> int | None:
    return int(label[2:]) if label.startswith("K=") else None


def _rel_labels(groups: dict[str, list[dict]]) -> list[tuple[int, str]]:
    return sorted((k, lab) for lab in groups if (k := _k_of(lab)) is not None)


def _reference(groups: dict[str, list[dict]], limit: int) -> str | None:
    """The label of the largest K <= ``limit`` (the training length): every offset seen in
    training has its own row, so it is the model clipping is compared with."""
    ks = [(k, lab) for k, lab in _rel_labels(groups) if k <= limit]
    return ks[-1][1] if ks else None


#: A run's (hits, count) on what a claim measures.
Counts = Callable[[dict], tuple[int, int]]


def _diff(groups: dict[str, list[dict]], first: str, second: str, counts: Counts) -> Interval:
    """Accuracy of ``second`` minus ``first``, paired by seed."""
    a = {r["spec"].get("seed", 0): counts(r) for r in groups[first]}
    b = {r["spec"].get("seed", 0): counts(r) for r in groups[second]}
    seeds = sorted(set(a) & set(b))
    return difference_interval([a[s] for s in seeds], [b[s] for s in seeds])


def _bpc_diff(groups: dict[str, list[dict]], first: str, second: str, length: int
              ) -> Interval:
    """Bits per character of ``second`` minus ``first``, paired by seed."""
    def per_seed(label: str) -> dict[int, dict]:
        return {r["spec"].get("seed", 0): ev for r in groups[label]
                if (ev := eval_at(r, length)) is not None}

    a, b = per_seed(first), per_seed(second)
    seeds = sorted(set(a) & set(b))
    diffs = [b[s]["bpc"] - a[s]["bpc"] for s in seeds]
    halves = []
    for s in seeds:
        xs, ys = a[s].get("bpc_per_sequence"), b[s].get("bpc_per_sequence")
        if xs and ys and len(xs) == len(ys) > 1:
            # The same windows (see evaluate.EVAL_SEED): the sequences' paired differences.
            ds = [y - x for x, y in zip(xs, ys, strict=True)]
            mean = sum(ds) / len(ds)
            sd = math.sqrt(sum((d - mean) ** 2 for d in ds) / (len(ds) - 1))
            halves.append(1.96 * sd / math.sqrt(len(ds)))
        elif a[s]["sequences"] > 1 and b[s]["sequences"] > 1:
            halves.append(1.96 * math.hypot(a[s]["bpc_sd"] / math.sqrt(a[s]["sequences"]),
                                            b[s]["bpc_sd"] / math.sqrt(b[s]["sequences"])))
    data_half = sum(halves) / len(halves) / math.sqrt(len(halves)) if halves else 0.0
    return mean_interval(diffs, data_half=data_half)


def _learned(groups: dict[str, list[dict]], labels: Sequence[str], counts: Counts) -> bool:
    """Whether any of the models ``labels`` reaches :data:`FLOOR` on ``counts`` (mean over
    seeds; below it the targets were not learned)."""
    return any(accuracy_interval([counts(r) for r in groups[lab]]).mean >= FLOOR
               for lab in labels if lab in groups)


NOT_LEARNED = f"inconclusive (not learned: every model's mean below {100 * FLOOR:g}%)"


def _enough(groups: dict[str, list[dict]], ref: str,
            gap: Callable[[str], Interval], margin: float, *,
            gaps: dict[int, tuple[str, Interval]] | None = None
            ) -> tuple[int | None, int | None]:
    """(smallest K shown within ``margin`` of ``ref``, largest K shown worse by more than
    ``margin``); ``gap(label)`` is ref's advantage over the model ``label``. ``gaps``, if
    given, receives every K's (label, gap interval)."""
    enough = short = None
    for k, lab in _rel_labels(groups):
        iv = Interval(0.0, 0.0, 0.0, 1) if lab == ref else gap(lab)
        if gaps is not None:
            gaps[k] = (lab, iv)
        if math.isnan(iv.mean):
            continue
        if iv.high < margin and enough is None:
            enough = k
        if iv.low > margin:
            short = k
    return enough, short


def undecided_ks(gaps: dict[int, tuple[str, Interval]], enough: int | None,
                 short: int | None, margin: float) -> list[tuple[str, Interval]]:
    """The K between the largest shown short and the smallest shown enough whose gap to the
    reference is neither, smallest first. Where K=8 is one of them only it is named: shown
    enough it makes the claim "no", shown short "yes" when a K in 16-128 is shown enough."""
    open_ = [(k, lab, iv) for k, (lab, iv) in sorted(gaps.items())
             if (short is None or k > short) and (enough is None or k < enough)
             and not math.isnan(iv.mean) and iv.low <= margin <= iv.high]
    key = [row for row in open_ if 8 <= row[0] < 16]
    return [(lab, iv) for _, lab, iv in (key or open_)]


def _range_verdict(enough: int | None, short: int | None) -> str:
    """Claim "the K needed lies in 16..128"."""
    if (enough is not None and enough < 16) or (short is not None and short >= 128):
        return "no"
    if enough is not None and 16 <= enough <= 128 and short is not None and short >= 8:
        return "yes"
    return "inconclusive"


def claims(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The claim rows: ``claim``, ``where``, ``measured`` (labelled), ``verdict``."""
    rows: list[dict[str, Any]] = []
    cfg = results["config"]
    for task in cfg["tasks"]:
        for depth in depths(results, task):
            groups = configurations(runs_of(results["runs"], task, depth))
            where = f"{task}, depth {depth}"
            n = train_length(results, task)
            ref = _reference(groups, n)
            if ref is None:
                continue
            code = task == CODE
            rows += _claims_of(groups, where, n, ref, code)
    return rows


def _claims_of(groups: dict[str, list[dict]], where: str, n: int, ref: str, code: bool
               ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def row(claim: str, measured: str, verdict: str, interval: Interval | None = None,
            threshold: float = math.nan, kind: str = "", unit: str = "pp") -> None:
        rows.append({"claim": claim, "where": where, "measured": measured, "verdict": verdict,
                     "interval": interval, "threshold": threshold, "kind": kind,
                     "unit": unit})

    what = "closing-bracket accuracy" if code else "accuracy"
    # 1. Typical K 16-128: the smallest K shown enough, overall.
    gaps: dict[int, tuple[str, Interval]] = {}
    if code:
        margin, unit = BPC_SMALL, "bits"
        enough, short = _enough(groups, ref, lambda lab: _bpc_diff(groups, ref, lab, n),
                                margin, gaps=gaps)
        basis = f"bits/char at length {n} within {BPC_SMALL:g} of {ref}"
    else:
        margin, unit = SMALL_PP / 100, "pp"
        enough, short = _enough(groups, ref, lambda lab: _diff(groups, lab, ref,
                                                               lambda r: overall_counts(r, n)),
                                margin, gaps=gaps)
        basis = f"overall accuracy at length {n} within {SMALL_PP:g} pp of {ref}"
    verdict = _range_verdict(enough, short)
    # Where the verdict waits on them, the K shown neither enough nor short, with their gaps.
    undecided = undecided_ks(gaps, enough, short, margin) if verdict == "inconclusive" else []
    shown = "".join(
        f"; {lab} minus {ref} {bits(iv, True)}" if code else f"; {ref} minus {lab} {pp(iv)}"
        for lab, iv in undecided)
    row("typical K is 16-128 (the K needed lies there)",
        f"{basis}: smallest K shown enough {kstr(enough, 'none')}, largest K shown not "
        f"enough {kstr(short, 'none')}{shown}", verdict)
    rows[-1].update(enough=enough, short=short, reference=ref, undecided=undecided,
                    threshold=margin, unit=unit)
    # 2. K=16 suffices for 10-20 token dependencies.
    if "K=16" in groups and ref != "K=16":
        counts = _subset(code, n, 10, 20)
        gap = _diff(groups, "K=16", ref, counts)
        a = accuracy_interval([counts(r) for r in groups["K=16"]])
        row("K=16 suffices for 10-20 token dependencies",
            f"subset d=10-20, {what}: K=16 {pct(a)}; {ref} minus K=16 {pp(gap)}",
            verdict_below(gap, SMALL_PP / 100) if _learned(groups, ("K=16", ref), counts)
            else NOT_LEARNED, gap, SMALL_PP / 100, "below")
    # 3. K=32 vs K=64 differ little.
    if "K=32" in groups and "K=64" in groups:
        if code:
            gap = _bpc_diff(groups, "K=32", "K=64", n)
            row("K=32 vs K=64 differ little",
                f"overall bits/char at length {n}: K=64 minus K=32 {bits(gap, True)} "
                f"(small: within ±{BPC_SMALL:g})", verdict_within(gap, BPC_SMALL), gap,
                BPC_SMALL, "within", "bits")
            counts = _subset(code, n, 33, 128)
            gap = _diff(groups, "K=32", "K=64", counts)
            row("K=32 vs K=64 differ little (brackets)",
                f"subset d=33-128, {what}: K=64 minus K=32 {pp(gap)}",
                verdict_within(gap, SMALL_PP / 100)
                if _learned(groups, ("K=32", "K=64"), counts) else NOT_LEARNED, gap,
                SMALL_PP / 100, "within")
        else:
            gap = _diff(groups, "K=32", "K=64", lambda r: overall_counts(r, n))
            row("K=32 vs K=64 differ little",
                f"overall accuracy at length {n}: K=64 minus K=32 {pp(gap)}",
                verdict_within(gap, SMALL_PP / 100), gap, SMALL_PP / 100, "within")
    # 4. K=4 vs K=16 differ significantly on long-range dependencies.
    if "K=4" in groups and "K=16" in groups:
        low = CODE_LONG if code else AGREE_LONG
        counts = _subset(code, n, low, n)
        gap = _diff(groups, "K=4", "K=16", counts)
        row("K=4 vs K=16 differ significantly on long-range dependencies",
            f"subset d={low}-{n}, {what}: K=16 minus K=4 {pp(gap)}",
            verdict_above(gap, SMALL_PP / 100) if _learned(groups, ("K=4", "K=16"), counts)
            else NOT_LEARNED, gap, SMALL_PP / 100, "above")
    return rows


def _gap(groups: dict[str, list[dict]], ref: str, counts: Counts
         ) -> Callable[[str], Interval]:
    """``label -> ref's accuracy minus label's`` on ``counts``."""
    return lambda label: _diff(groups, label, ref, counts)


def _subset(code: bool, n: int, low: int, high: int) -> Counts:
    """Per-run (hits, count) of the subset ``low <= d <= high`` at length ``n``: closing
    brackets by opener distance (``pysrc``: the claims' 10-20 range, or the buckets inside
    the range), or synthetic targets by dependency distance."""
    if code:
        return code_counts(n, low, high)
    return lambda r: pooled_counts(r, n, lambda d: low <= d <= high)


def guidance_rows(results: dict[str, Any], task: str, depth: int) -> list[dict[str, Any]]:
    """Per dependency range of ``task`` at ``depth``: ``span`` (``"4"`` or ``"5-16"``),
    ``learned`` (some model reaches :data:`FLOOR`), ``enough`` (the smallest K shown within
    :data:`SMALL_PP` of the reference, or None), ``short`` (the largest K shown worse, or
    None), ``reference`` (the reference's accuracy interval) and ``ref`` (its label)."""
    n = train_length(results, task)
    groups = configurations(runs_of(results["runs"], task, depth))
    ref = _reference(groups, n)
    if ref is None:
        return []
    code = task == CODE
    if code:
        ranges = [(lo, hi) for lo, hi in BUCKETS if lo < n]
    else:
        distances = sorted({d for runs in groups.values() for r in runs
                            for d in by_distance(r, n)})
        ranges = [(d, d) for d in distances]
    rows = []
    for lo, hi in ranges:
        counts = _subset(code, n, lo, hi)
        enough, short = _enough(groups, ref, _gap(groups, ref, counts), SMALL_PP / 100)
        rows.append({"span": f"{lo}" if lo == hi else f"{lo}-{hi}",
                     "learned": _learned(groups, list(groups), counts),
                     "enough": enough, "short": short,
                     "reference": accuracy_interval([counts(r) for r in groups[ref]]),
                     "ref": ref})
    return rows


def guidance(results: dict[str, Any], task: str, depth: int) -> list[str]:
    """Per dependency range: the smallest K shown enough and the largest shown not (rows of
    the report's table)."""
    lines = []
    for row in guidance_rows(results, task, depth):
        head = f"| {task}, depth {depth} | {row['span']} |"
        if not row["learned"]:
            lines.append(f"{head} not learned (every model's mean below {100 * FLOOR:g}%) | - "
                         f"| {pct(row['reference'])} |")
            continue
        lines.append(f"{head} {kstr(row['enough'], 'none shown')} | "
                     f"{kstr(row['short'], '-')} | {pct(row['reference'])} |")
    return lines


def signal_claims(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The claim rows on the training signal of the table rows (``pysrc``): the distant rows
    of the unclipped table are undertrained, and clipping beats the unclipped table beyond
    the training length (none without an unclipped model that recorded the signal)."""
    groups = signal_groups(results)
    if not groups:
        return []
    n = train_length(results, CODE)
    rows: list[dict[str, Any]] = []
    far = "unclipped" if "unclipped" in groups else None
    if far is None:
        return rows

    def ratio(key: str, far_rows: range) -> Interval:
        logs = []
        for r in groups[far]:
            s = r["signal"][key]
            near = sum(s[1:9]) / 8
            distant = sum(s[d] for d in far_rows) / len(far_rows)
            if near > 0 and distant > 0:
                logs.append(math.log10(distant / near))
        return mean_interval(logs)

    for far_rows, rows_label in ((range(n - 1, n), f"d={n - 1}"),
                                 (range(n // 2, n), f"d={n // 2}-{n - 1}")):
        pairs = sum(n - d for d in far_rows) / len(far_rows) / (n - 4.5)
        for key, what in (("mean_grad_norm", "gradient norm"), ("moved", "distance moved")):
            iv = ratio(key, far_rows)
            rows.append({
                "claim": "distant offsets are undertrained (>= 10x less signal)",
                "where": f"{CODE}, unclipped, {what}, rows {rows_label}",
                "measured": (f"log10(rows {rows_label} / rows d=1-8) = {iv.mean:+.2f} "
                             f"[{iv.low:+.2f}, {iv.high:+.2f}] (pairs: "
                             f"{math.log10(pairs):+.2f})"),
                "verdict": verdict_below(iv, -1.0),
                "interval": iv, "threshold": -1.0, "kind": "below", "unit": "log10",
            })
    all_groups = configurations(runs_of(results["runs"], CODE))
    longest = max(eval_lengths(results, CODE))
    ref = _reference(all_groups, n)
    if ref is not None and far in all_groups:
        gap = _bpc_diff(all_groups, ref, far, longest)
        rows.append({
            "claim": "clipping beats the unclipped table beyond the training length",
            "where": f"{CODE}, length {longest} ({longest // n}x)",
            "measured": (f"bits/char, unclipped minus {ref}: {bits(gap, True)}"
                         + over(gap, results["config"])),
            "verdict": verdict_above(gap, BPC_SMALL),
            "interval": gap, "threshold": BPC_SMALL, "kind": "above", "unit": "bits",
        })
        # The reference's own clip row (d >= K = L) never meets a training pair, so it is
        # as untrained as the unclipped table's far rows; the largest K below the training
        # length is the clipped model whose clip row is trained.
        trained = [lab for k, lab in _rel_labels(all_groups) if k < n]
        if trained and trained[-1] != ref:
            gap = _bpc_diff(all_groups, trained[-1], far, longest)
            rows.append({
                "claim": "clipping beats the unclipped table beyond the training length",
                "where": (f"{CODE}, length {longest} ({longest // n}x), against {trained[-1]} "
                          f"(the largest K < L: its clip row is trained)"),
                "measured": (f"bits/char, unclipped minus {trained[-1]}: "
                             f"{bits(gap, True)}" + over(gap, results["config"])),
                "verdict": verdict_above(gap, BPC_SMALL),
                "interval": gap, "threshold": BPC_SMALL, "kind": "above", "unit": "bits",
            })
    return rows
