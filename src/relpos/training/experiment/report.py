"""The report of the K sweep: what K to choose, the seed's claims with verdicts, tables,
the training-signal measurement and figures.

Every number and statement in ``report.md`` is computed from the results document that
:func:`relpos.training.experiment.run_experiment` writes (``results.json.gz``); none is
written in advance. Numbers are means over seeds with 95% intervals
(:mod:`~relpos.training.experiment.stats`); a verdict is "yes" or "no" only when its
interval lies on one side of the claim's threshold, "inconclusive" otherwise.
:func:`make_report` is pure (results in, markdown out); :func:`write_report` also draws the
figures and writes the file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relpos._io import atomic_write_text
from relpos.training.experiment.results import (
    AGREE_LONG,
    BPC_SMALL,
    CODE_LONG,
    PLATEAU_PP,
    bpc_interval,
    bracket_counts,
    by_distance,
    code_counts,
    configurations,
    curve_metrics,
    curves,
    depths,
    overall_counts,
    pooled_counts,
    runs_of,
    train_length,
)
from relpos.training.experiment.stats import (
    Interval,
    accuracy_interval,
    difference_interval,
    mean_interval,
    t_quantile,
    verdict_above,
    verdict_below,
    verdict_within,
)

__all__ = ["BPC_SMALL", "LARGE_PP", "SMALL_PP", "claims", "make_report", "write_report"]

#: A difference in accuracy below this (percentage points) is "small"; a K is "enough" when
#: it is shown to be within it of the reference. Stated in the report.
SMALL_PP = 2.0
#: Kept for callers of the first report; no verdict uses it any more.
LARGE_PP = 5.0
CODE = "pysrc"
#: A subset on which no compared model's interval reaches this accuracy was not learned:
#: its comparisons say nothing about K.
FLOOR = 0.10


def write_report(results: dict[str, Any], out: Path) -> str:
    """Draw the figures into ``out``, write ``out/report.md`` and return its text."""
    from relpos.training.experiment.figures import write_figures

    figures = write_figures(results, out)
    report = make_report(results, figures=[f.name for f in figures])
    atomic_write_text(out / "report.md", report)
    return report


# --- formatting --------------------------------------------------------------------------


def _pct(iv: Interval) -> str:
    if math.isnan(iv.mean):
        return "n/a"
    return f"{100 * iv.mean:.1f}% [{100 * iv.low:.1f}, {100 * iv.high:.1f}]"


def _pct_short(iv: Interval) -> str:
    if math.isnan(iv.mean):
        return ""
    return f"{100 * iv.mean:.1f} ±{100 * iv.half:.1f}"


def _pp(iv: Interval) -> str:
    if math.isnan(iv.mean):
        return "n/a"
    return f"{100 * iv.mean:+.1f} pp [{100 * iv.low:+.1f}, {100 * iv.high:+.1f}]"


def _bits(iv: Interval, sign: bool = False) -> str:
    if math.isnan(iv.mean):
        return "n/a"
    f = "+.3f" if sign else ".3f"
    return f"{iv.mean:{f}} [{iv.low:{f}}, {iv.high:{f}}]"


def _k_of(label: str) -> int | None:
    return int(label[2:]) if label.startswith("K=") else None


def _rel_labels(groups: dict[str, list[dict]]) -> list[tuple[int, str]]:
    return sorted((k, lab) for lab in groups if (k := _k_of(lab)) is not None)


def _eval_lengths(results: dict[str, Any], task: str) -> list[int]:
    cfg = results["config"]
    if task == CODE:
        return [cfg["code_train_length"] * f for f in cfg["code_eval_factors"]]
    return list(cfg["eval_lengths"])


def _reference(groups: dict[str, list[dict]], limit: int) -> str | None:
    """The label of the largest K <= ``limit`` (the training length): every offset seen in
    training has its own row, so it is the model clipping is compared with."""
    ks = [(k, lab) for k, lab in _rel_labels(groups) if k <= limit]
    return ks[-1][1] if ks else None


# --- what the numbers say ----------------------------------------------------------------


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
    from relpos.training.experiment.results import eval_at

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
            # The same windows (see run.EVAL_SEED): the sequences' paired differences.
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


def _undecided(gaps: dict[int, tuple[str, Interval]], enough: int | None,
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


def _kstr(k: int | None, none: str) -> str:
    return none if k is None else f"K={k}"


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

    def subset(low: int, high: int) -> Counts:
        if code:
            return code_counts(n, low, high)
        return lambda r: pooled_counts(r, n, lambda d: low <= d <= high)

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
    undecided = _undecided(gaps, enough, short, margin) if verdict == "inconclusive" else []
    shown = "".join(
        f"; {lab} minus {ref} {_bits(iv, True)}" if code else f"; {ref} minus {lab} {_pp(iv)}"
        for lab, iv in undecided)
    row("typical K is 16-128 (the K needed lies there)",
        f"{basis}: smallest K shown enough {_kstr(enough, 'none')}, largest K shown not "
        f"enough {_kstr(short, 'none')}{shown}", verdict)
    rows[-1].update(enough=enough, short=short, reference=ref, undecided=undecided,
                    threshold=margin, unit=unit)
    # 2. K=16 suffices for 10-20 token dependencies.
    if "K=16" in groups and ref != "K=16":
        counts = subset(10, 20)
        gap = _diff(groups, "K=16", ref, counts)
        a = accuracy_interval([counts(r) for r in groups["K=16"]])
        row("K=16 suffices for 10-20 token dependencies",
            f"subset d=10-20, {what}: K=16 {_pct(a)}; {ref} minus K=16 {_pp(gap)}",
            verdict_below(gap, SMALL_PP / 100) if _learned(groups, ("K=16", ref), counts)
            else NOT_LEARNED, gap, SMALL_PP / 100, "below")
    # 3. K=32 vs K=64 differ little.
    if "K=32" in groups and "K=64" in groups:
        if code:
            gap = _bpc_diff(groups, "K=32", "K=64", n)
            row("K=32 vs K=64 differ little",
                f"overall bits/char at length {n}: K=64 minus K=32 {_bits(gap, True)} "
                f"(small: within ±{BPC_SMALL:g})", verdict_within(gap, BPC_SMALL), gap,
                BPC_SMALL, "within", "bits")
            counts = subset(33, 128)
            gap = _diff(groups, "K=32", "K=64", counts)
            row("K=32 vs K=64 differ little (brackets)",
                f"subset d=33-128, {what}: K=64 minus K=32 {_pp(gap)}",
                verdict_within(gap, SMALL_PP / 100)
                if _learned(groups, ("K=32", "K=64"), counts) else NOT_LEARNED, gap,
                SMALL_PP / 100, "within")
        else:
            gap = _diff(groups, "K=32", "K=64", lambda r: overall_counts(r, n))
            row("K=32 vs K=64 differ little",
                f"overall accuracy at length {n}: K=64 minus K=32 {_pp(gap)}",
                verdict_within(gap, SMALL_PP / 100), gap, SMALL_PP / 100, "within")
    # 4. K=4 vs K=16 differ significantly on long-range dependencies.
    if "K=4" in groups and "K=16" in groups:
        low = CODE_LONG if code else AGREE_LONG
        counts = subset(low, n)
        gap = _diff(groups, "K=4", "K=16", counts)
        row("K=4 vs K=16 differ significantly on long-range dependencies",
            f"subset d={low}-{n}, {what}: K=16 minus K=4 {_pp(gap)}",
            verdict_above(gap, SMALL_PP / 100) if _learned(groups, ("K=4", "K=16"), counts)
            else NOT_LEARNED, gap, SMALL_PP / 100, "above")
    return rows


def _gap(groups: dict[str, list[dict]], ref: str, counts: Counts
         ) -> Callable[[str], Interval]:
    """``label -> ref's accuracy minus label's`` on ``counts``."""
    return lambda label: _diff(groups, label, ref, counts)


def _range_counts(code: bool, n: int, lo: int, hi: int) -> Counts:
    """Per-run (hits, count) of the subset lo <= d <= hi at length ``n``."""
    if code:
        label = f"{lo}-{hi}"
        return lambda r: bracket_counts(r, n, label)
    return lambda r: pooled_counts(r, n, lambda d: lo <= d <= hi)


def _guidance(results: dict[str, Any], task: str, depth: int) -> list[str]:
    """Per dependency range: the smallest K shown enough and the largest shown not."""
    n = train_length(results, task)
    groups = configurations(runs_of(results["runs"], task, depth))
    ref = _reference(groups, n)
    if ref is None:
        return []
    code = task == CODE
    if code:
        from relpos.training.experiment.results import BUCKETS

        ranges = [(lo, hi) for lo, hi in BUCKETS if lo < n]
    else:
        distances = sorted({d for runs in groups.values() for r in runs
                            for d in by_distance(r, n)})
        ranges = [(d, d) for d in distances]
    lines = []
    for lo, hi in ranges:
        counts = _range_counts(code, n, lo, hi)
        enough, short = _enough(groups, ref, _gap(groups, ref, counts), SMALL_PP / 100)
        best = accuracy_interval([counts(r) for r in groups[ref]])
        span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        if not _learned(groups, list(groups), counts):
            lines.append(f"| {task}, depth {depth} | {span} | not learned (every model's "
                         f"mean below {100 * FLOOR:g}%) | - | {_pct(best)} |")
            continue
        lines.append(f"| {task}, depth {depth} | {span} | {_kstr(enough, 'none shown')} | "
                     f"{_kstr(short, '-')} | {_pct(best)} |")
    return lines


def _signal_summary(results: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """Lines on the per-row training signal and the undertraining claim rows."""
    runs = [r for r in runs_of(results["runs"], CODE) if "signal" in r]
    if not runs:
        return [], []
    n = int(results["config"]["code_train_length"])
    groups = configurations(runs)
    lines = [
        f"Per table row (distance back d; keys and values together, mean over layers), "
        f"training length {n}. Pairs per batch are exact ((L - d) per sequence, the last "
        "row of a clipped table collects every d >= K); gradient norm is the mean over "
        "training steps of the row's raw gradient norm; moved is |W_end - W_init| of the "
        "row. Means over seeds.",
        "",
        "| model | d | pairs/batch | mean grad norm | moved |",
        "|---|---|---|---|---|",
    ]
    for label, group in groups.items():
        sig = [r["signal"] for r in group]
        k = sig[0]["k"]
        ds = sorted({d for d in (0, 1, 4, 16, 64, n // 2, n - 1, n, 4 * n - 1, 8 * n - 1, k)
                     if 0 <= d <= k})
        for d in ds:
            pairs = sig[0]["pairs_per_batch"][d]
            grad = sum(s["mean_grad_norm"][d] for s in sig) / len(sig)
            moved = sum(s["moved"][d] for s in sig) / len(sig)
            lines.append(f"| {label} | {d}{' (= K)' if d == k else ''} | {pairs:,} | "
                         f"{grad:.3g} | {moved:.3g} |")
    rows: list[dict[str, Any]] = []
    far = "unclipped" if "unclipped" in groups else None
    if far is None:
        return lines, rows

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
    longest = max(_eval_lengths(results, CODE))
    ref = _reference(all_groups, n)
    if ref is not None and far in all_groups:
        gap = _bpc_diff(all_groups, ref, far, longest)
        rows.append({
            "claim": "clipping beats the unclipped table beyond the training length",
            "where": f"{CODE}, length {longest} ({longest // n}x)",
            "measured": (f"bits/char, unclipped minus {ref}: {_bits(gap, True)}"
                         + _over(gap, results["config"])),
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
                             f"{_bits(gap, True)}" + _over(gap, results["config"])),
                "verdict": verdict_above(gap, BPC_SMALL),
                "interval": gap, "threshold": BPC_SMALL, "kind": "above", "unit": "bits",
            })
    return lines, rows


# --- the claims, answered -------------------------------------------------------------------

#: The seed's words behind each claim row (by the row's ``claim``).
SEED_WORDS = {
    "typical K is 16-128 (the K needed lies there)":
        "Typical values range from 16 to 128",
    "K=16 suffices for 10-20 token dependencies":
        "For sentence-level tasks where the longest dependencies span 10-20 tokens, k = 16 "
        "often suffices",
    "K=32 vs K=64 differ little":
        "the performance difference between k = 32 and k = 64 is often small",
    "K=32 vs K=64 differ little (brackets)":
        "the performance difference between k = 32 and k = 64 is often small (on the "
        "brackets whose opener is 33-128 back)",
    "K=4 vs K=16 differ significantly on long-range dependencies":
        "the difference between k = 4 and k = 16 can be significant for tasks involving "
        "long-range grammatical dependencies",
    "distant offsets are undertrained (>= 10x less signal)":
        "The embedding for offset +127 would be severely undertrained",
    "clipping beats the unclipped table beyond the training length":
        "distant-position embeddings never become reliable (so clipping them should help "
        "beyond the training length)",
}
#: An inconclusive claim is "shown within" this half-width (pp of accuracy; bits per
#: character: BPC_SMALL).
NARROW_PP = 5.0
_MAX_SEEDS = 200


def _seeds_for(spread: float, half: float) -> int | None:
    """The fewest seeds whose t interval at the seeds' standard deviation ``spread`` is
    narrower than ``half`` (None beyond :data:`_MAX_SEEDS`)."""
    for m in range(2, _MAX_SEEDS + 1):
        if t_quantile(m - 1) * spread / math.sqrt(m) < half:
            return m
    return None


def _to_settle(row: dict[str, Any]) -> str:
    """What an inconclusive row would take to decide (and whether it is already narrow)."""
    iv: Interval | None = row.get("interval")
    if row["verdict"].startswith("inconclusive (not learned"):
        return ("training until the subset is learned: no compared model reaches "
                f"{100 * FLOOR:g}% on it")
    if "reference" in row:  # the range claim: which K are shown enough and short
        missing: list[str] = []
        if row.get("enough") is None:
            missing.append(f"a K below {row['reference']} shown within the margin of it")
        if row.get("short") is None or row["short"] < 8:
            missing.append("K=8 or a larger K shown short of it")
        said = ("the gaps to the reference narrowed until there is " + " and ".join(missing)
                if missing else "the gaps to the reference narrowed")
        # Each K between the two, shown either way, moves one of them.
        for lab, gap in row.get("undecided", ()):
            said += f"; {lab} shown either way: " + _seeds_to_decide(
                gap, row["threshold"], "above", row.get("unit", "pp"))
        return said
    if iv is None or math.isnan(iv.mean) or not row.get("kind"):
        return "a narrower interval"
    return _seeds_to_decide(iv, row["threshold"], row["kind"], row.get("unit", "pp"))


def _seeds_to_decide(iv: Interval, thr: float, kind: str, unit: str) -> str:
    """How far ``iv`` is from deciding its claim (``kind`` ``above`` / ``below`` /
    ``within`` ``thr``): its half-width, and the seeds or positions that would do it."""
    scale, fmt = (100.0, "{:.1f} pp") if unit == "pp" else (1.0, "{:.3f}")
    dist = abs(abs(iv.mean) - thr) if kind == "within" else abs(iv.mean - thr)
    narrow = NARROW_PP / 100 if unit == "pp" else BPC_SMALL
    said = f"half-width {fmt.format(iv.half * scale)}"
    if unit in ("pp", "bits"):
        said += (" (within ±" + fmt.format(narrow * scale) + ")" if iv.half <= narrow
                 else " (wider than ±" + fmt.format(narrow * scale) + ")")
    if dist * scale < (0.05 if unit == "pp" else 0.0005):
        return f"{said}; the mean sits on the threshold: no number of runs decides it"
    if iv.source == "positions":
        more = (iv.half / dist) ** 2
        return (f"{said}, set by the scored positions: about {more:.1f}x as many (more "
                "evaluation tokens or seeds) would decide it")
    spread = iv.half * math.sqrt(iv.n) / t_quantile(max(iv.n - 1, 1))
    need = _seeds_for(spread, dist)
    if need is None:
        return (f"{said}, set by the seeds; the mean is {fmt.format(dist * scale)} from the "
                f"threshold: over {_MAX_SEEDS} seeds at this spread")
    return (f"{said}, set by the seeds (sd {fmt.format(spread * scale)}): about {need} "
            f"seeds at this spread would decide it")


def _span(seeds: Sequence[int]) -> str:
    """``0-9`` for consecutive seeds, else the list."""
    xs = list(seeds)
    if len(xs) > 2 and xs == list(range(xs[0], xs[0] + len(xs))):
        return f"{xs[0]}-{xs[-1]}"
    return ", ".join(map(str, xs))


def _seed_text(cfg: dict[str, Any]) -> str:
    """``3 seeds (0, 1, 2)``, or per task when ``pysrc`` has seeds of its own (and its
    models with extra seeds)."""
    seeds = list(cfg.get("seeds", [cfg.get("seed", 0)]))
    code = cfg.get("code_seeds")
    tasks = list(cfg.get("tasks", []))
    if CODE in tasks and tasks != [CODE] and code is not None and list(code) != seeds:
        others = [t for t in tasks if t != CODE]
        said = (f"{len(seeds)} seeds ({_span(seeds)}) for {', '.join(others)} and "
                f"{len(code)} ({_span(code)}) for {CODE}")
    else:
        shown = list(code) if tasks == [CODE] and code is not None else seeds
        said = f"{len(shown)} seed(s) ({_span(shown)})"
    return said + _extra_seed_text(cfg)


def _extra_seed_text(cfg: dict[str, Any]) -> str:
    """`` (K=128 and unclipped of pysrc: 41 more seeds (20-60); ...)``, or nothing."""
    extra, models = cfg.get("code_extra_seeds") or [], cfg.get("code_extra_models") or []
    if not extra or not models or CODE not in cfg.get("tasks", []):
        return ""
    return (f" ({' and '.join(models)} of {CODE}: {len(extra)} more seeds ({_span(extra)}); "
            "a comparison pairs the seeds both its models have)")


def _over(iv: Interval, cfg: dict[str, Any]) -> str:
    """`` over 61 seeds`` where some ``pysrc`` models have extra seeds (a comparison's count
    then depends on its models), else nothing."""
    return f" over {iv.n} seeds" if _extra_seed_text(cfg) else ""


def _extra_models_note(cfg: dict[str, Any], groups: dict[str, list[dict]]) -> str:
    """The sentence on the ``pysrc`` models trained with extra seeds (their rows below are
    means over all of their seeds)."""
    models = [m for m in cfg.get("code_extra_models") or [] if m in groups]
    if not cfg.get("code_extra_seeds") or not models:
        return ""
    counts = ", ".join(f"{m} {len(groups[m])}" for m in models)
    return (f" {' and '.join(models)} are trained with more seeds than the others "
            f"({counts} runs): their rows are means over all of them, and a comparison "
            "pairs the seeds both of its models have.")


def _claims_section(rows: list[dict[str, Any]], seeds: str) -> list[str]:
    lines = [
        "## The seed's claims, answered",
        "",
        f"Each claim of the handbook section, per task, with the evidence ({seeds}, "
        f"95% intervals) and the verdict: YES or NO when the interval lies on one side of "
        f"the claim's threshold ({SMALL_PP:g} pp of accuracy, {BPC_SMALL:g} bits per "
        f"character, 10x for the training signal), otherwise inconclusive, with what would "
        f"settle it and whether the interval is already within ±{NARROW_PP:g} pp "
        f"(±{BPC_SMALL:g} bits per character).",
        "",
    ]
    order: list[str] = []
    for r in rows:
        if r["claim"] not in order:
            order.append(r["claim"])
    for number, claim in enumerate(order, 1):
        mine = [r for r in rows if r["claim"] == claim]
        tally = []
        for word in ("yes", "no"):
            wheres = [r["where"] for r in mine if r["verdict"] == word]
            if wheres:
                tally.append(f"**{word.upper()}** on {'; '.join(wheres)}.")
        undecided = [r["where"] for r in mine if r["verdict"].startswith("inconclusive")]
        if undecided:
            tally.append(f"Inconclusive on {'; '.join(undecided)}.")
        lines += [
            f"### {number}. {claim}",
            "",
            f"The seed: \"{SEED_WORDS.get(claim, claim)}.\" {' '.join(tally)}",
            "",
            "| task, depth | evidence (labelled: overall or subset) | verdict | to settle it |",
            "|---|---|---|---|",
        ]
        for r in mine:
            verdict = r["verdict"]
            shown = verdict.upper() if verdict in ("yes", "no") else verdict
            settle = _to_settle(r) if verdict.startswith("inconclusive") else "-"
            lines.append(f"| {r['where']} | {r['measured']} | {shown} | {settle} |")
        lines.append("")
    return lines


# --- learning curves -----------------------------------------------------------------------

def _curves_section(results: dict[str, Any]) -> list[str]:
    cfg = results["config"]
    blocks = []
    for task in cfg["tasks"]:
        for depth in depths(results, task):
            points = curves(results["runs"], task, depth)
            if points:
                blocks.append((task, depth, points))
    if not blocks:
        return []
    lines = [
        "## Step budget: learning curves",
        "",
        "Before the sweep's budget is trusted, the curve models are trained again at other "
        "budgets (each a run of its own, with its own warmup and cosine schedule): shorter "
        "ones, and any longer one probes whether the sweep's models have stopped learning. "
        f"The sweep's own runs give its budget's point ({_sweep_budgets(cfg)}). Means over "
        "the curve seeds, with every seed's change over the last doubling of the budget. "
        "A metric has "
        f"**plateaued** when every seed moved less than {PLATEAU_PP:g} pp "
        f"({BPC_SMALL:g} bits per character) over the last doubling, is **still changing** "
        "when every seed moved more, and is mixed otherwise.",
        "",
    ]
    for task, depth, points in blocks:
        budgets = sorted({b for by in points.values() for b in by})
        seeds = sorted({r["spec"].get("seed", 0) for by in points.values()
                        for g in by.values() for r in g})
        lines += [
            f"### `{task}`, depth {depth} (seeds {', '.join(map(str, seeds))})",
            "",
            "| model | metric | " + " | ".join(f"{b} steps" for b in budgets)
            + " | last doubling, per seed | plateau |",
            "|---|---|" + "---|" * len(budgets) + "---|---|",
        ]
        for label, by in points.items():
            for name, value, thr, unit in curve_metrics(results, task):
                scale, fmt = (100.0, "{:.1f}") if unit == "pp" else (1.0, "{:.3f}")
                cells = []
                for b in budgets:
                    vals = [value(r) for r in by.get(b, []) if not math.isnan(value(r))]
                    cells.append(fmt.format(scale * sum(vals) / len(vals)) if vals else "")
                changes = _last_changes(by, value)
                if changes:
                    sign = "{:+.1f}" if unit == "pp" else "{:+.3f}"
                    shown = ", ".join(sign.format(scale * c) for c in changes)
                    if all(abs(c) < thr for c in changes):
                        plateau = "plateaued"
                    elif all(abs(c) >= thr for c in changes):
                        plateau = "still changing"
                    else:
                        plateau = "mixed"
                else:
                    shown, plateau = "", ""
                lines.append(f"| {label} | {name} | " + " | ".join(cells)
                             + f" | {shown} | {plateau} |")
        lines.append("")
    return lines


def _sweep_budgets(cfg: dict[str, Any]) -> str:
    """The sweep's step budget per task, for the curve section's text."""
    steps = {task: cfg["code_steps"] if task == CODE else cfg["steps"] for task in cfg["tasks"]}
    return ", ".join(f"{n} steps for `{task}`" for task, n in steps.items())


def _last_changes(by: dict[int, list[dict]], value: Callable[[dict], float]) -> list[float]:
    """Per seed: the metric at the largest budget minus the metric at the next one."""
    budgets = sorted(by)
    if len(budgets) < 2:
        return []
    last = {r["spec"].get("seed", 0): value(r) for r in by[budgets[-1]]}
    before = {r["spec"].get("seed", 0): value(r) for r in by[budgets[-2]]}
    return [last[s] - before[s] for s in sorted(set(last) & set(before))
            if not (math.isnan(last[s]) or math.isnan(before[s]))]


# --- tables --------------------------------------------------------------------------------


def _distance_table(groups: dict[str, list[dict]], n: int) -> list[str]:
    distances = sorted({d for g in groups.values() for r in g for d in by_distance(r, n)})
    lines = [
        "| model | " + " | ".join(f"d={d}" for d in distances) + " | overall |",
        "|---" * (len(distances) + 2) + "|",
    ]
    for label, g in groups.items():
        cells = [_pct_short(accuracy_interval([by_distance(r, n).get(d, (0, 0)) for r in g]))
                 for d in distances]
        overall = _pct_short(accuracy_interval([overall_counts(r, n) for r in g]))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {overall} |")
    return lines


def _length_table(groups: dict[str, list[dict]], lengths: Sequence[int]) -> list[str]:
    lines = [
        "| model | " + " | ".join(f"L={m}" for m in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for label, g in groups.items():
        cells = [_pct_short(accuracy_interval([overall_counts(r, m) for r in g]))
                 for m in lengths]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _bpc_table(groups: dict[str, list[dict]], lengths: Sequence[int]) -> list[str]:
    lines = [
        "| model | " + " | ".join(f"L={m}" for m in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for label, g in groups.items():
        cells = []
        for m in lengths:
            iv = bpc_interval(g, m)
            cells.append("" if math.isnan(iv.mean) else f"{iv.mean:.3f} ±{iv.half:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _bracket_table(groups: dict[str, list[dict]], length: int, kind: str = "hits"
                   ) -> list[str]:
    from relpos.training.experiment.results import BUCKETS

    labels = [f"{lo}-{hi}" for lo, hi in BUCKETS if lo < length]
    lines = [
        "| model | " + " | ".join(f"d={b}" for b in labels) + " |",
        "|---" * (len(labels) + 1) + "|",
    ]
    for label, g in groups.items():
        cells = [_pct_short(accuracy_interval([bracket_counts(r, length, b, kind=kind)
                                               for r in g])) for b in labels]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    counts = [sum(bracket_counts(r, length, b)[1] for r in next(iter(groups.values())))
              for b in labels]
    lines.append("| closers scored (all seeds) | " + " | ".join(f"{c:,}" for c in counts)
                 + " |")
    return lines


# --- the document ----------------------------------------------------------------------------


def _machine(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    return (f"{env.get('cpu', 'unknown CPU')} ({env.get('isa', '?')}, torch CPU capability "
            f"{env.get('torch_cpu_capability', '?')}, {env.get('logical_cpus', '?')} logical "
            f"CPUs), torch {env.get('torch', '?')}, Python {env.get('python', '?')}, "
            f"{env.get('threads', '?')} torch thread(s)")


def _wall_time(results: dict[str, Any]) -> str:
    """The sweep's wall time: this invocation's, with its estimate where it trained runs,
    and the earlier invocations' whose finished runs it reused."""
    wall = results.get("sweep_seconds", math.nan) / 60
    estimate = results.get("estimated_seconds", math.nan)
    # Documents from before reuse was recorded trained every run they hold.
    trained = results.get("trained_runs", len(results.get("runs", ())))
    guess = (f" (estimated up front: {estimate / 60:.1f} min)"
             if trained and not math.isnan(estimate) else "")
    reused = results.get("reused_runs", 0)
    if not reused:
        return f"Wall time of the sweep: {wall:.1f} min{guess}."
    earlier = results.get("earlier_seconds", 0.0) / 60
    return (f"Wall time of the sweep: {wall + earlier:.1f} min in all. This invocation "
            f"trained {trained} run(s) in {wall:.1f} min{guess} and reused {reused} "
            f"finished one(s) of earlier invocations of the same sweep, which took "
            f"{earlier:.1f} min.{_invocation_machines(results)}")


def _invocation_machines(results: dict[str, Any]) -> str:
    """Which CPU trained the runs, invocation by invocation (empty when one invocation
    trained them all)."""
    trained = [i for i in results.get("invocations", ()) if i.get("trained_runs") != 0]
    if len(trained) < 2:
        return ""
    parts = []
    for i in trained:
        runs = "" if i.get("trained_runs") is None else f"{i['trained_runs']} run(s), "
        parts.append(f"{i.get('cpu') or 'CPU not recorded'} ({runs}{i['seconds'] / 60:.1f} min)")
    return " The invocations that trained runs, in order: " + "; ".join(parts) + "."


def make_report(results: dict[str, Any], *, figures: Sequence[str] = ()) -> str:
    """The markdown report; every number and verdict is computed from ``results``."""
    cfg = results["config"]
    lines = [
        "# Where does the clip distance K matter?",
        "",
        f"Command: `{results.get('command', 'relpos experiment')}`. Machine: "
        f"{_machine(results)}. {_wall_time(results)}",
        "",
        f"Every number is a mean over {_seed_text(cfg)} with "
        "a 95% interval: the wider of a Student-t interval over the seeds and an interval over "
        "the scored positions (Wilson's for an accuracy; a normal one for a difference, paired "
        "by seed, or a mean bits-per-character). A claim gets 'yes' or 'no' only when its "
        "interval lies entirely on one side of the claim's threshold "
        f"({SMALL_PP:g} pp of accuracy, {BPC_SMALL:g} bits per character); otherwise "
        "'inconclusive'. Each measurement says whether it is an overall number (every scored "
        "position) or a subset (positions with a dependency distance d in a range). The "
        "reference model of a task is the largest K not above its training length: every "
        "offset seen in training has its own table row.",
        "",
    ]
    signal_lines, signal_rows = _signal_summary(results)
    rows = claims(results) + signal_rows
    lines += _claims_section(rows, _seed_text(cfg))
    lines += _curves_section(results)
    guide = [line for task in cfg["tasks"] for depth in depths(results, task)
             for line in _guidance(results, task, depth)]
    if guide:
        lines += [
            "## Which K to choose",
            "",
            "Per dependency distance d (training length; subset accuracy, for `pysrc` the "
            "closing bracket whose opener is d characters back): the smallest K shown within "
            f"{SMALL_PP:g} pp of the reference, and the largest K shown worse than that.",
            "",
            "| task, depth | d | smallest K shown enough | largest K shown not enough | "
            "reference accuracy |",
            "|---|---|---|---|---|",
            *guide,
            "",
        ]
    for task in cfg["tasks"]:
        n = train_length(results, task)
        if task == CODE:
            corpus = results.get("corpus", {})
            groups = configurations(runs_of(results["runs"], task))
            lengths = _eval_lengths(results, task)
            files = corpus.get("files", {})
            chars = corpus.get("characters", {})
            lines += [
                f"## Real data: `{task}`, a character-level LM on Python's standard library",
                "",
                f"Corpus: the `.py` files under `{corpus.get('root', '?')}` (no site-packages, "
                f"no test directories, no file over 256 KB), split by a hash of the relative "
                f"path: {files.get('train', '?')} train / {files.get('validation', '?')} "
                f"validation / {files.get('test', '?')} test files "
                f"({chars.get('train', 0) / 1e6:.1f}M / {chars.get('validation', 0) / 1e6:.1f}M"
                f" / {chars.get('test', 0) / 1e6:.1f}M characters; non-ASCII share "
                f"{100 * corpus.get('non_ascii_share', 0):.3f}%; digest "
                f"`{corpus.get('digest', '?')[:12]}`). Depth {cfg['code_depth']}, d_model "
                f"{cfg['d_model']}, trained {cfg['code_steps']} steps x "
                f"{cfg['code_batch_size']} windows of {n} characters (lr {cfg['code_lr']:g}); "
                f"evaluated on about {cfg['code_eval_tokens']:,} validation characters per "
                "length. `unclipped` has K = longest evaluation length - 1: no offset it meets "
                "is clipped, and its rows for d >= the training length are never trained."
                + _extra_models_note(cfg, groups),
                "",
                "### Validation bits per character (overall: every character)",
                "",
                *_bpc_table(groups, lengths),
                "",
            ]
            for m in (n, max(lengths)):
                lines += [
                    f"### Closing-bracket accuracy by opener distance d at length {m} "
                    "(subset: closers whose opener is in the window; argmax over all "
                    "characters)",
                    "",
                    *_bracket_table(groups, m),
                    "",
                ]
            lines += [
                f"### Bracket type at length {n} (subset: the right closer ranked above the "
                "other two)",
                "",
                *_bracket_table(groups, n, kind="type_hits"),
                "",
            ]
            if signal_lines:
                lines += ["### Training signal per table row", "", *signal_lines, ""]
            continue
        chance = results["chance"][task]
        for depth in depths(results, task):
            groups = configurations(runs_of(results["runs"], task, depth))
            lines += [
                f"## Synthetic: `{task}`, depth {depth} (chance {100 * chance:.1f}%)",
                "",
                f"Trained {cfg['steps']} steps x {cfg['batch_size']} sequences of length {n} "
                f"(lr {cfg['lr']:g}); about {cfg['eval_tokens']:,} evaluated tokens per "
                "length. Accuracy in %, mean ±95% half-width.",
                "",
                f"Subset accuracy by distance d at length {n}, and overall:",
                "",
                *_distance_table(groups, n),
                "",
                "Overall accuracy by evaluation length:",
                "",
                *_length_table(groups, _eval_lengths(results, task)),
                "",
            ]
    if figures:
        lines += [
            "## Figures",
            "",
            "Heatmaps: mean accuracy by model and distance, colour scale fitted to the data "
            "(the numbers are printed in the cells; a white tick marks d = K). Bits per "
            "character: mean with the 95% band. Extrapolation: mean by evaluation length "
            "with bands. Signal: per-row pairs, gradient norm and distance moved.",
            "",
            *[f"![{f}]({f})" for f in figures],
            "",
        ]
    lines += ["## Reproduce", "", "```", results.get("command", "relpos experiment"), "```", "",
              "Reruns with the same command, seeds and thread count on the same machine give "
              "identical numbers; another CPU (ISA) or torch build gives slightly different "
              "numbers, which the intervals are there to absorb.", ""]
    return "\n".join(lines)
