"""The report of the K sweep: the claims of the handbook section on clipped relative
positions (Shaw et al., 2018) with verdicts, what K to choose, tables, the training-signal
measurement and figures; and the short summary of it that ``relpos experiment`` prints.

Every number and statement in ``report.md`` is computed from the results document that
:func:`relpos.training.experiment.run_experiment` writes (``results.json.gz``); none is
written in advance. Numbers are means over seeds with 95% intervals
(:mod:`~relpos.training.experiment.stats`); a verdict is "yes" or "no" only when its
interval lies on one side of the claim's threshold, "inconclusive" otherwise (the claims and
their verdicts: :mod:`~relpos.training.experiment.claims`; what would settle an inconclusive
one: :mod:`~relpos.training.experiment.seeds`). :func:`make_report` is pure (results in,
markdown out); :func:`write_report` also draws the figures and writes the file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relpos._deprecated import module_getattr
from relpos._io import atomic_write_text
from relpos.training.experiment.claims import SMALL_PP, claims, guidance, signal_claims
from relpos.training.experiment.formatting import extra_models_note, pct_short, seed_text
from relpos.training.experiment.results import (
    BPC_SMALL,
    BUCKETS,
    CODE,
    PLATEAU_PP,
    bpc_interval,
    bracket_counts,
    by_distance,
    configurations,
    curve_metrics,
    curves,
    depths,
    eval_lengths,
    overall_counts,
    runs_of,
    signal_groups,
    train_length,
)
from relpos.training.experiment.seeds import NARROW_PP, to_settle
from relpos.training.experiment.stats import accuracy_interval

__all__ = ["BPC_SMALL", "SMALL_PP", "claims", "make_report", "make_summary", "write_report"]

# LARGE_PP (5.0) was kept for callers of the first report; no verdict uses it. Deprecated in
# 0.1, the name goes in 0.2.
__getattr__ = module_getattr(__name__, {
    "LARGE_PP": ("the value 5.0 (no verdict uses it; the name goes in 0.2)", lambda: 5.0),
})


#: What the study answers: the handbook section on clipped relative positions.
SOURCE = "the handbook section on clipped relative positions (Shaw et al., 2018)"
#: The handbook section's words behind each claim row (by the row's ``claim``).
HANDBOOK_WORDS = {
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


def write_report(results: dict[str, Any], out: Path) -> str:
    """Draw the figures into ``out``, write ``out/report.md`` and return its text."""
    from relpos.training.experiment.figures import write_figures

    figures = write_figures(results, out)
    report = make_report(results, figures=[f.name for f in figures])
    atomic_write_text(out / "report.md", report)
    return report


def _signal_table(results: dict[str, Any]) -> list[str]:
    """The lines on the training signal each table row received (``pysrc``; none if no run
    recorded it)."""
    groups = signal_groups(results)
    if not groups:
        return []
    n = train_length(results, CODE)
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
    return lines


def _claims_section(rows: list[dict[str, Any]], seeds: str) -> list[str]:
    lines = [
        "## The claims, answered",
        "",
        f"Each claim of {SOURCE} that the study tests, per task, with the evidence ({seeds}, "
        f"95% intervals) and the verdict: YES or NO when the interval lies on one side of "
        f"the claim's threshold ({SMALL_PP:g} pp of accuracy, {BPC_SMALL:g} bits per "
        f"character, 10x for the training signal), otherwise inconclusive, with what would "
        f"settle it and whether the interval is already within ±{NARROW_PP:g} pp "
        f"(±{BPC_SMALL:g} bits per character).",
        "",
    ]
    for number, (claim, mine) in enumerate(_by_claim(rows), 1):
        lines += [
            f"### {number}. {claim}",
            "",
            f"The handbook: \"{HANDBOOK_WORDS.get(claim, claim)}.\" {_tally(mine)}",
            "",
            "| task, depth | evidence (labelled: overall or subset) | verdict | to settle it |",
            "|---|---|---|---|",
        ]
        for r in mine:
            verdict = r["verdict"]
            shown = verdict.upper() if verdict in ("yes", "no") else verdict
            settle = to_settle(r) if verdict.startswith("inconclusive") else "-"
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
        cells = [pct_short(accuracy_interval([by_distance(r, n).get(d, (0, 0)) for r in g]))
                 for d in distances]
        overall = pct_short(accuracy_interval([overall_counts(r, n) for r in g]))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {overall} |")
    return lines


def _model_table(groups: dict[str, list[dict]], headers: Sequence[str],
                 cells: Callable[[list[dict]], list[str]]) -> list[str]:
    """A markdown table with a row per model of ``groups``: ``cells(its runs)`` under
    ``headers``."""
    lines = [
        "| model | " + " | ".join(headers) + " |",
        "|---" * (len(headers) + 1) + "|",
    ]
    for label, g in groups.items():
        lines.append(f"| {label} | " + " | ".join(cells(g)) + " |")
    return lines


def _length_table(groups: dict[str, list[dict]], lengths: Sequence[int]) -> list[str]:
    return _model_table(groups, [f"L={m}" for m in lengths], lambda g: [
        pct_short(accuracy_interval([overall_counts(r, m) for r in g])) for m in lengths])


def _bpc_cell(g: list[dict], length: int) -> str:
    iv = bpc_interval(g, length)
    return "" if math.isnan(iv.mean) else f"{iv.mean:.3f} ±{iv.half:.3f}"


def _bpc_table(groups: dict[str, list[dict]], lengths: Sequence[int]) -> list[str]:
    return _model_table(groups, [f"L={m}" for m in lengths],
                        lambda g: [_bpc_cell(g, m) for m in lengths])


def _bracket_table(groups: dict[str, list[dict]], length: int, kind: str = "hits"
                   ) -> list[str]:
    labels = [f"{lo}-{hi}" for lo, hi in BUCKETS if lo < length]
    lines = _model_table(groups, [f"d={b}" for b in labels], lambda g: [
        pct_short(accuracy_interval([bracket_counts(r, length, b, kind=kind) for r in g]))
        for b in labels])
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
        f"Every number is a mean over {seed_text(cfg)} with "
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
    signal_lines = _signal_table(results)
    rows = claims(results) + signal_claims(results)
    lines += _claims_section(rows, seed_text(cfg))
    lines += _curves_section(results)
    guide = [line for task in cfg["tasks"] for depth in depths(results, task)
             for line in guidance(results, task, depth)]
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
            lengths = eval_lengths(results, task)
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
                + extra_models_note(cfg, groups),
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
                *_length_table(groups, eval_lengths(results, task)),
                "",
            ]
    if figures:
        lines += [
            "## Figures",
            "",
            "Heatmaps: mean accuracy by model and distance, colour scale fitted to the data "
            "(the numbers, in %, are printed in the cells; a white bar outlined in black "
            "marks d = K; a column without a scored target is left out). Bits per "
            "character: mean with the 95% band, the absolute baselines as horizontal lines. "
            "Extrapolation: mean by evaluation length, each model's 95% interval a bar beside "
            "its point, chance dotted. Signal: per-row pairs, "
            "gradient norm and distance moved.",
            "",
            *[f"![{f}]({f})" for f in figures],
            "",
        ]
    lines += ["## Reproduce", "", "```", results.get("command", "relpos experiment"), "```", "",
              _reference_time(cfg) + "Reruns with the same command, seeds and thread count on "
              "the same machine give identical numbers; another CPU (ISA) or torch build gives "
              "slightly different numbers, which the intervals are there to absorb.", ""]
    return "\n".join(lines)


def _reference_time(cfg: dict[str, Any]) -> str:
    """``This sweep takes about 20 minutes on 2 CPU cores ...`` (the sweep's
    :func:`~relpos.training.experiment.calibrate.time_claim`), or nothing for a document
    whose configuration this version cannot read."""
    from relpos.training.experiment.calibrate import time_claim
    from relpos.training.experiment.config import ExperimentConfig

    try:
        claim = time_claim(ExperimentConfig.from_dict(cfg))
    except (TypeError, ValueError):
        return ""
    return (f"This sweep takes {claim} (a job of one torch thread per core, nothing else "
            "running; the estimate printed up front is timed on the machine at hand). ")


def _tally(mine: list[dict[str, Any]]) -> str:
    """``**YES** on recall, depth 1. Inconclusive on agree, depth 1.``: a claim's verdicts,
    task by task (``bold``: YES and NO in markdown bold)."""
    tally = []
    for word in ("yes", "no"):
        wheres = [r["where"] for r in mine if r["verdict"] == word]
        if wheres:
            tally.append(f"**{word.upper()}** on {'; '.join(wheres)}.")
    undecided = [r["where"] for r in mine if r["verdict"].startswith("inconclusive")]
    if undecided:
        tally.append(f"Inconclusive on {'; '.join(undecided)}.")
    return " ".join(tally)


def _by_claim(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The claim rows grouped by claim, in the order they first appear."""
    order: list[str] = []
    for r in rows:
        if r["claim"] not in order:
            order.append(r["claim"])
    return [(claim, [r for r in rows if r["claim"] == claim]) for claim in order]


def _k_choice(rows: list[dict[str, Any]]) -> str:
    """``K=4 for d=1-3; K=8 for d=4-6; not learned for d=5-16``: the smallest K shown enough,
    over runs of consecutive distance ranges that share it."""
    parts: list[tuple[str, list[str]]] = []
    for row in rows:
        said = (("K=" + str(row["enough"])) if row["enough"] is not None else "none shown"
                ) if row["learned"] else "not learned"
        if parts and parts[-1][0] == said:
            parts[-1][1].append(row["span"])
        else:
            parts.append((said, [row["span"]]))

    def spans(xs: list[str]) -> str:
        first, last = xs[0].split("-")[0], xs[-1].split("-")[-1]
        return first if first == last else f"{first}-{last}"

    return "; ".join(f"{said} for d={spans(xs)}" for said, xs in parts)


def make_summary(results: dict[str, Any], report: Path, figures: Sequence[Path] = ()) -> str:
    """What ``relpos experiment`` prints when it is done (the report itself is in
    ``report``): the sweep in one line, each claim's verdicts in one line, which K to
    choose per task and depth, and the paths of the report and the figures."""
    from relpos.training.experiment.claims import guidance_rows

    cfg = results["config"]
    runs = len(results.get("runs", ()))
    wall = (results.get("sweep_seconds", math.nan) + results.get("earlier_seconds", 0.0)) / 60
    lines = [f"relpos experiment: {runs} runs, {seed_text(cfg)}; {wall:.1f} min."]
    grouped = _by_claim(claims(results) + signal_claims(results))
    if grouped:
        lines.append(f"The claims of {SOURCE}, with their verdicts per task (evidence and "
                     "95% intervals in the report):")
        lines += [f"  {n}. {claim}: {_tally(mine).replace('**', '')}"
                  for n, (claim, mine) in enumerate(grouped, 1)]
    choice = [(f"{task}, depth {depth}", rows) for task in cfg["tasks"]
              for depth in depths(results, task)
              if (rows := guidance_rows(results, task, depth))]
    if choice:
        lines.append(f"Which K to choose: the smallest K shown within {SMALL_PP:g} pp of the "
                     "reference, by dependency distance d:")
        lines += [f"  {where} (reference {rows[0]['ref']}): {_k_choice(rows)}"
                  for where, rows in choice]
    lines.append(f"Report: {report}")
    if figures:
        folder = Path(figures[0]).parent
        lines.append(f"Figures in {folder}: " + ", ".join(Path(f).name for f in figures))
    return "\n".join(lines)
