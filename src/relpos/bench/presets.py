"""``relpos bench --preset training``: attention at training shapes, every backend against
plain scaled dot-product attention.

A training batch holds a fixed number of tokens (``--tokens``, default 4096), spread over
sequence lengths: B x n = 64x64, 32x128, 16x256, 8x512, 4x1024, 2x2048, 1x4096 (n the powers
of two from 64 up to the budget, B = tokens // n; :func:`token_shapes`). At each shape it
times self-attention with both relative terms (keys and values, tables shared by the heads),
H=8, D=64, for K in {16, 64}, causal and not, forward (under ``torch.no_grad``) and forward +
backward (of a random upstream gradient), with the backends ``auto`` (``implementation=None``,
and the backend :func:`relpos.select_backend` says it picks), ``native``, ``flash_regions``,
``bucketed`` and ``reference``, and ``F.scaled_dot_product_attention`` without relative
terms. All cases of one shape (every K, causal flag, backend and SDPA) run in the same
interleaved rounds, the order rotated by one case each round
(:func:`relpos.bench.common.interleaved_medians`), medians reported, so the ratios to SDPA
compare numbers taken side by side.

Skipped, with the reason in the table: the reference above n = 512 (it materializes
``(n, n, D)`` tables: 4 n² D bytes each in float32, their gradients, and the score
matrices), and any case whose estimated peak exceeds the memory budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relpos.bench import attention, common, memory

__all__ = [
    "DEFAULT_TOKENS",
    "PASSES",
    "REFERENCE_MAX_N",
    "TrainingResult",
    "TrainingSettings",
    "reference_skip",
    "run_training",
    "time_passes",
    "token_shapes",
    "training_backends",
    "training_settings",
]

#: Tokens per batch (B x n) of the training shapes.
DEFAULT_TOKENS = 4096
#: The shortest sequence of the default shapes.
MIN_LENGTH = 64
#: The reference backend runs at n <= this only (its (n, n, D) tables).
REFERENCE_MAX_N = 512
#: "auto is within 10% of the fastest": auto's time at most this times the fastest one's.
WITHIN = 1.10
DEFAULT_MAX_DISTANCES = (16, 64)
QUICK_TOKENS = 1024
QUICK_MAX_DISTANCES = (16,)
#: The timed passes, in the order each round runs them.
PASSES = ("fwd", "fwd+bwd")


def token_shapes(tokens: int, lengths: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The ``(B, n)`` shapes of a batch of ``tokens`` tokens: for each sequence length n,
    ``B = tokens // n`` (so ``B * n <= tokens``, equal when n divides it).

    Args:
        tokens: tokens per batch (>= 1).
        lengths: the sequence lengths; None = the powers of two from 64 up to ``tokens``.

    Returns:
        ``[(B, n), ...]`` in the order of ``lengths``.

    Raises:
        ValueError: if ``tokens`` < 1, a length is < 1 or > ``tokens``, or ``lengths`` is None
            and ``tokens`` < 64.

    Example:
        >>> token_shapes(4096)
        [(64, 64), (32, 128), (16, 256), (8, 512), (4, 1024), (2, 2048), (1, 4096)]
        >>> token_shapes(4096, [128, 512])
        [(32, 128), (8, 512)]
    """
    if tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    if lengths is None:
        if tokens < MIN_LENGTH:
            raise ValueError(f"--tokens {tokens}: the default lengths start at n = {MIN_LENGTH}; "
                             "allowed: --tokens >= 64, or --lengths at most --tokens")
        lengths = [MIN_LENGTH << i for i in range((tokens // MIN_LENGTH).bit_length())]
    bad = [n for n in lengths if not 1 <= n <= tokens]
    if bad:
        raise ValueError(f"--lengths {','.join(map(str, lengths))}: n = {bad[0]} does not fit "
                         f"in a batch of --tokens {tokens}; allowed: 1..{tokens}")
    return [(tokens // n, n) for n in lengths]


def training_backends() -> tuple[str, ...]:
    """What ``--backends`` may name with ``--preset training``: ``auto`` and every
    whole-sequence CPU backend (``decode`` serves KV-cache steps; ``triton`` is for GPUs).
    SDPA always runs."""
    from relpos.functional import available_backends

    return ("auto", *(b for b in available_backends() if b not in ("decode", "triton")))


@dataclass
class TokenSweep(common.Timing):
    """What the presets sweep: batches of ``tokens`` tokens, one ``(B, n)`` of ``shapes`` per
    sequence length, each clip distance of ``max_distances``; each case timed as
    :class:`~relpos.bench.common.Timing` says."""

    tokens: int
    shapes: list[tuple[int, int]]
    max_distances: list[int]

    def sweep_options(self) -> str:
        """``--tokens``, ``--lengths`` and ``--max-distances``, as a command spells them."""
        return (f"--tokens {self.tokens} --lengths {','.join(str(n) for _, n in self.shapes)} "
                f"--max-distances {','.join(map(str, self.max_distances))}")


def read_sweep(args: Any, *, tokens: int, lengths: Sequence[int] | None,
               max_distances: Sequence[int]) -> dict[str, Any]:
    """The :class:`TokenSweep` fields a preset's options ``args`` ask for at ``tokens`` tokens
    a batch (``--lengths`` and ``--max-distances`` read with ``getattr``; missing or None = the
    defaults given, :func:`token_shapes`'s when ``lengths`` is None), checked.

    Raises:
        ValueError: on a length that does not fit ``tokens``, a negative clip distance or a
            timing out of range (:func:`~relpos.bench.common.timing`).
    """
    chosen = getattr(args, "lengths", None) or lengths
    Ks = getattr(args, "max_distances", None)
    Ks = list(max_distances if Ks is None else Ks)
    if min(Ks, default=0) < 0:
        raise ValueError("--max-distances must be >= 0")
    return {"tokens": tokens, "shapes": token_shapes(tokens, None if chosen is None
                                                     else list(chosen)),
            "max_distances": Ks, **common.timing(args, repeats=5)}


@dataclass
class TrainingSettings(TokenSweep):
    """One ``--preset training`` run, resolved from the options."""

    causal: list[bool]
    heads: int
    head_dim: int
    backends: list[str]
    memory_budget_gib: float | None

    def command(self, threads: int, out: str | None) -> str:
        """The ``relpos bench --preset training`` command with every setting spelled out."""
        return (
            f"relpos bench --preset training {self.sweep_options()} --heads {self.heads} "
            f"--head-dim {self.head_dim} {self.timing_options()} --backends "
            f"{','.join(self.backends)} --threads {threads}"
            + (" --causal" if self.causal == [True] else "")
            + ("" if self.memory_budget_gib is None
               else f" --memory-budget {self.memory_budget_gib:g}")
            + (f" --out {out}" if out else "")
        )


def training_settings(args: argparse.Namespace) -> TrainingSettings:
    """The run the ``relpos bench --preset training`` options ask for (attributes read with
    ``getattr``; missing or None = the default), checked.

    Raises:
        ValueError: on an unknown backend or a setting out of range.
    """

    def get(name: str) -> Any:
        return getattr(args, name, None)

    quick = bool(get("quick"))
    tokens = int(get("tokens") or (QUICK_TOKENS if quick else DEFAULT_TOKENS))
    backends = (list(training_backends()) if get("backends") is None
                else list(common.check_backends(get("backends"), training_backends())))
    budget = get("memory_budget")
    if budget is not None and not budget > 0:
        raise ValueError(f"--memory-budget must be a positive number of GiB, got {budget}")
    quick_lengths = [n for n in (64, 256, 1024) if n <= tokens] or None
    settings = TrainingSettings(
        **read_sweep(args, tokens=tokens, lengths=quick_lengths if quick else None,
                     max_distances=QUICK_MAX_DISTANCES if quick else DEFAULT_MAX_DISTANCES),
        causal=[True] if get("causal") else [False, True],
        heads=get("heads") or 8,
        head_dim=get("head_dim") or 64,
        backends=backends,
        memory_budget_gib=budget,
    )
    for name in ("heads", "head_dim"):
        if getattr(settings, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(settings, name)}")
    return settings


# ----------------------------------------------------------------------------------------------
# Cases


@dataclass
class TrainingResult:
    """One case: a backend (or ``"sdpa"``, ``K`` None) at one shape, K and causal flag;
    ``ms`` maps each pass of :data:`PASSES` to its median milliseconds, empty when the case
    did not run (``note`` says why); ``auto`` is the backend ``implementation=None`` picks."""

    B: int
    n: int
    K: int | None
    causal: bool
    backend: str
    auto: dict[str, str] = dataclasses.field(default_factory=dict)  # pass -> backend
    ms: dict[str, float] = dataclasses.field(default_factory=dict)
    note: str = ""


def _attention_config(s: TrainingSettings, B: int, causal: bool) -> attention.Config:
    """The :class:`relpos.bench.attention.Config` of one shape (its input builders and
    memory estimate take one)."""
    return attention.Config(
        lengths=[], max_distances=[], batch=B, heads=s.heads, head_dim=s.head_dim,
        dtype=s.dtype, repeats=s.repeats, warmup=s.warmup, backends=[], memory=False,
        causal=causal,
    )


def reference_skip(backend: str, n: int) -> str:
    """Why ``backend`` does not run at length ``n``: the reference above
    :data:`REFERENCE_MAX_N` ("" = it runs)."""
    if backend == "reference" and n > REFERENCE_MAX_N:
        return (f"skipped: n > {REFERENCE_MAX_N} (the reference materializes (n, n, D) "
                "tables)")
    return ""


def _skip_reason(backend: str, n: int, K: int, cfg: attention.Config, budget: int) -> str:
    """Why the case does not run ("" = it runs)."""
    if reason := reference_skip(backend, n):
        return reason
    need = attention.estimate_bytes(backend, n, K, cfg)
    if need > budget:
        return f"skipped: needs ~{need / 2**30:.1f} GiB > the {budget / 2**30:.1f} GiB budget"
    return ""


def _picked(n: int, K: int, x: dict[str, Any]) -> dict[str, str]:
    """The backend ``implementation=None`` runs for these inputs, per pass: the forward runs
    under ``torch.no_grad`` (auto-selection weighs whether a backward follows)."""
    from relpos.functional import select_backend

    def pick() -> str:
        return select_backend(x["q"], x["k"], x["v"], max_distance=K, rel_keys=x["ak"],
                              rel_values=x["av"], is_causal=x["causal"])

    with torch.no_grad():
        forward = pick()
    return {PASSES[0]: forward, PASSES[1]: pick()}


def _run_shape(
    B: int, n: int, s: TrainingSettings, budget: int, tick: Callable[[str], None]
) -> list[TrainingResult]:
    """Every case of one shape, timed in the same interleaved rounds."""
    results: list[TrainingResult] = []
    calls: dict[int, list[Callable[[], object]]] = {}
    by_K: dict[int, dict[str, Any]] = {}  # inputs per K, shared by causal flags and backends
    for K in s.max_distances:
        by_K[K] = attention.make_inputs(n, K, _attention_config(s, B, False))
    for causal in s.causal:
        cfg = _attention_config(s, B, causal)
        first = {**by_K[s.max_distances[0]], "causal": causal}
        cases: list[tuple[str, int | None, dict[str, Any]]] = [("sdpa", None, first)] + [
            (backend, K, {**by_K[K], "causal": causal})
            for K in s.max_distances for backend in s.backends
        ]
        for backend, case_K, x in cases:
            r = TrainingResult(B, n, case_K, causal, backend)
            results.append(r)
            if case_K is not None:
                r.auto = _picked(n, case_K, x)
                worst = r.auto[PASSES[1]] if backend == "auto" else backend
                r.note = _skip_reason(worst, n, case_K, cfg, budget)
            if not r.note:
                calls[len(results) - 1] = [
                    functools.partial(fn, backend, x, case_K or 0)
                    for fn in (attention.forward, attention.forward_backward)
                ]

    labels = [f"K={r.K} {'causal ' if r.causal else ''}{r.backend}" for r in results]
    time_passes(calls, results, f"{B}x{n}", labels, s.warmup, s.repeats, tick)
    return results


def time_passes(
    calls: Mapping[int, Sequence[Callable[[], object]]], results: Sequence[Any], shape: str,
    labels: Sequence[str], warmup: int, repeats: int, tick: Callable[[str], None],
) -> None:
    """Time the cases of one shape in the same interleaved rounds, the order rotating by one
    case each round (:func:`relpos.bench.common.interleaved_medians`).

    Args:
        calls: index into ``results`` -> its calls, one per pass of :data:`PASSES`.
        results: each gets ``ms`` (pass -> median ms) when it ran, else a ``note`` saying
            why not (its call raised ``RuntimeError``).
        shape, labels: the progress label of each call: ``"{shape} {round} {labels[i]}"``.
        warmup, repeats: unmeasured and measured rounds.
        tick: the progress bar's (:func:`relpos.bench.attention.progress`).
    """

    def label(i: int, round_: int) -> None:
        what = "warm-up" if round_ < warmup else f"round {round_ - warmup + 1}/{repeats}"
        tick(f"{shape} {what} {labels[i]}")

    medians, failures = common.interleaved_medians(
        calls, warmup=warmup, repeats=repeats, tick=label, errors=(RuntimeError,), rotate=True,
    )
    for i, ms in medians.items():
        results[i].ms = dict(zip(PASSES, ms, strict=True))
    for i, message in failures.items():
        results[i].note = f"failed: {message[:80]}"


def run_training(args: argparse.Namespace) -> int:
    """Run ``relpos bench --preset training``: print the tables, and write
    ``training.md`` and ``training.csv`` into ``args.out`` when it is set.

    Args:
        args: the ``relpos bench`` options (see :func:`training_settings`), plus ``threads``
            and ``out``.

    Returns:
        0 (the exit status).
    """
    s = training_settings(args)
    threads = common.use_threads(getattr(args, "threads", None))
    budget = (int(0.6 * memory.available_bytes()) if s.memory_budget_gib is None
              else int(s.memory_budget_gib * 2**30))
    clock = common.RunClock()
    per_shape = len(s.causal) * (1 + len(s.max_distances) * len(s.backends))
    tick, close = attention.progress(len(s.shapes) * per_shape * (s.warmup + s.repeats))
    results: list[TrainingResult] = []
    try:
        for B, n in s.shapes:
            results += _run_shape(B, n, s, budget, tick)
    finally:
        close()
    tables = _tables(results, s)
    print("\n\n".join("\n".join(t) for t in tables))
    out = getattr(args, "out", None)
    if out:
        meta = {
            **common.command_header(args, s.command(threads, out), threads),
            "shapes": f"{s.tokens} tokens per batch: B = {s.tokens} // n; H={s.heads}, "
                      f"D={s.head_dim}, self-attention (L = S = n), {s.dtype}, keys and values "
                      "terms (tables of 2K+1 rows shared by the heads)",
            "timing": f"{s.warmup} warm-up round(s), then the median of {s.repeats} rounds; "
                      "a round runs every case of one shape in turn (every K, causal flag, "
                      "backend and SDPA: interleaved, so a slow spell of the machine hits all "
                      "alike), starting one case later each round (no case always follows the "
                      "same one); each case: forward under torch.no_grad(), then forward + "
                      "backward of a random upstream gradient",
            "skips": f"the reference above n = {REFERENCE_MAX_N}; cases whose estimated "
                     f"peak exceeds {budget / 2**30:.1f} GiB (--memory-budget; default 60% of "
                     "the available memory); memory is not measured (plain relpos bench does)",
            **clock.meta(),
        }
        md, csv = common.report_files(out, "training")
        common.write_files({md: _markdown(tables, meta, csv.name), csv: _csv(results)})
        print(f"wrote {md} and {csv}")
    return 0


# ----------------------------------------------------------------------------------------------
# Reporting


def _by_key(results: list[TrainingResult]) -> dict[tuple[Any, ...], TrainingResult]:
    return {(r.B, r.n, r.K, r.causal, r.backend): r for r in results}


def _tables(results: list[TrainingResult], s: TrainingSettings) -> list[list[str]]:
    """One markdown table per K (with its heading line): a row per shape, causal flag and
    pass; each backend's median ms and ratio to SDPA, auto's pick, the fastest backend and
    whether auto is within 10% of it."""
    found = _by_key(results)
    named = [b for b in s.backends if b != "auto"]
    head = ["B x n", "causal", "pass", *s.backends, "SDPA ms", "auto picks", "fastest",
            f"auto within {round(100 * (WITHIN - 1))}% of fastest"]
    tables = []
    for K in s.max_distances:
        rows = []
        for B, n in s.shapes:
            for causal in s.causal:
                sdpa = found[(B, n, None, causal, "sdpa")]
                for pass_ in PASSES:
                    floor = sdpa.ms.get(pass_)
                    cells, times = [], {}
                    for backend in s.backends:
                        r = found[(B, n, K, causal, backend)]
                        if pass_ in r.ms:
                            times[backend] = r.ms[pass_]
                            ratio = "" if not floor else f" ({r.ms[pass_] / floor:.2f}x)"
                            cells.append(f"{common.format_ms(r.ms[pass_])} ms{ratio}")
                        else:
                            cells.append(r.note or "-")
                    ran = {b: times[b] for b in named if b in times}
                    fastest = min(ran, key=ran.__getitem__) if ran else None
                    verdict = "-"
                    if fastest is not None and "auto" in times:
                        over = times["auto"] / ran[fastest]
                        verdict = f"{'yes' if over <= WITHIN else 'no'} ({over:.2f}x)"
                    rows.append([
                        f"{B} x {n}", "yes" if causal else "no", pass_, *cells,
                        common.format_ms(floor) if floor is not None else sdpa.note or "-",
                        found[(B, n, K, causal, s.backends[0])].auto.get(pass_, "-"),
                        fastest or "-", verdict,
                    ])
        tables.append([f"### K = {K}", "", *common.markdown_table(head, rows)])
    return tables


def _markdown(tables: list[list[str]], meta: dict[str, str], csv_name: str) -> str:
    lines = [
        "# relpos attention at training shapes",
        "",
        "Self-attention with clipped relative keys and values terms at a fixed number of "
        "tokens per batch. Each backend's cell is its median time and, in parentheses, its "
        "ratio to `F.scaled_dot_product_attention` without relative terms (same causal flag, "
        "same pass) measured in the same interleaved rounds; `auto` is "
        "`implementation=None`, `auto picks` the backend `relpos.select_backend` names for "
        "the call, `fastest` the fastest backend asked for by name.",
        "",
        *common.markdown_meta(meta),
        "",
        f"Raw numbers: [`{csv_name}`]({csv_name}).",
        "",
    ]
    for table in tables:
        lines += [*table, ""]
    return "\n".join(lines)


def _csv(results: list[TrainingResult]) -> str:
    floors = {(r.B, r.n, r.causal): r.ms for r in results if r.backend == "sdpa"}
    rows = []
    for r in results:
        for pass_ in PASSES:
            ms, floor = r.ms.get(pass_), floors.get((r.B, r.n, r.causal), {}).get(pass_)
            rows.append([
                r.B, r.n, "" if r.K is None else r.K, int(r.causal), pass_, r.backend,
                r.auto.get(pass_, ""),
                "" if ms is None else f"{ms:.4g}",
                "" if ms is None or not floor else f"{ms / floor:.4g}", r.note,
            ])
    return common.csv_text(
        ["B", "n", "K", "causal", "pass", "backend", "auto_backend", "ms", "over_sdpa", "note"],
        rows,
    )
