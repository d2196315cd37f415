"""Attention benchmark: relpos backends against plain scaled dot-product attention.

For every sequence length n and clip distance K it times, in this one process, the forward
(under ``torch.no_grad``) and the forward + backward of each backend on self-attention with
both relative terms, and of ``F.scaled_dot_product_attention`` without relative terms (the
floor): warm-up rounds, then the median of measured rounds, each of which runs every backend
of one n in turn (:func:`relpos.bench.common.interleaved_medians`), so that a slow spell of a
shared machine hits all backends alike. Peak memory of one forward + backward is measured per
case in a fresh ``spawn`` subprocess (:mod:`relpos.bench.memory`). Cases that would not fit
in memory are skipped with the estimate. ``relpos bench`` runs it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from relpos.bench import common, memory

__all__ = [
    "Config",
    "Result",
    "backends",
    "config",
    "default_backends",
    "estimate_bytes",
    "forward",
    "forward_backward",
    "make_inputs",
    "measure_memory",
    "progress",
    "run_attention",
]

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_MAX_DISTANCES = (16, 64)
QUICK_LENGTHS = (256, 512)
QUICK_MAX_DISTANCES = (16,)
MEMORY_METHOD = memory.METHOD


def backends() -> tuple[str, ...]:
    """What ``--backends`` may name: ``"auto"`` (what ``implementation=None`` picks),
    :func:`relpos.available_backends` and ``"sdpa"``."""
    from relpos.functional import available_backends

    return ("auto", *available_backends(), "sdpa")


def default_backends() -> tuple[str, ...]:
    """What runs without ``--backends``: auto (its note names the backend it picks) and every
    backend but ``decode``, which serves KV-cache steps (``relpos bench --decode``), not
    whole-sequence attention, and ``triton``, a GPU backend (``python -m relpos.bench.cuda_check
    --triton`` times it)."""
    return tuple(b for b in backends() if b not in ("decode", "triton"))


# ----------------------------------------------------------------------------------------------
# Cases


@dataclass
class Config(common.Timing):
    """One benchmark run: the sweep (lengths x clip distances x backends), the shape and how
    each case is timed."""

    lengths: list[int]
    max_distances: list[int]
    batch: int
    heads: int
    head_dim: int
    backends: list[str]
    memory: bool
    causal: bool = False


@dataclass
class Result:
    """The measurements of one case (n, K, backend); ``skipped`` says why one is missing."""

    n: int
    K: int
    backend: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    peak_mib: float | None = None
    skipped: str = ""
    picks: str = ""  # auto: the backends it picks
    extra: dict[str, float] = field(default_factory=dict)


def config(args: argparse.Namespace) -> Config:
    """The run ``relpos bench`` options ask for (None = the default), checked.

    Raises:
        ValueError: on an unknown backend or a length out of range.
    """
    quick = bool(getattr(args, "quick", False))
    chosen = (
        default_backends() if args.backends is None
        else common.check_backends(args.backends, backends())
    )
    lengths = list(args.lengths or (QUICK_LENGTHS if quick else DEFAULT_LENGTHS))
    if any(n < 1 for n in lengths):
        raise ValueError(f"--lengths must be positive, got {lengths}")
    return Config(
        lengths=lengths,
        max_distances=list(args.max_distances if args.max_distances is not None
                           else (QUICK_MAX_DISTANCES if quick else DEFAULT_MAX_DISTANCES)),
        batch=args.batch or 1,
        heads=args.heads or 8,
        head_dim=args.head_dim or 64,
        **common.timing(args, repeats=3),
        backends=list(chosen),
        memory=bool(getattr(args, "memory", True)),
        causal=bool(getattr(args, "causal", False)),
    )


def auto_picks(n: int, K: int, cfg: Config) -> tuple[str, str]:
    """The backends ``implementation=None`` picks for a case: for the forward alone (no
    gradient) and for the forward + backward."""
    from relpos.functional import select_backend

    dtype = getattr(torch, cfg.dtype)
    q = torch.empty(cfg.batch, cfg.heads, n, cfg.head_dim, dtype=dtype, requires_grad=True)
    table = torch.empty(2 * K + 1, cfg.head_dim, dtype=dtype, requires_grad=True)
    kw = dict(max_distance=K, rel_keys=table, rel_values=table, is_causal=cfg.causal)
    with torch.no_grad():
        fwd = select_backend(q, q, q, **kw)  # type: ignore[arg-type]
    return fwd, select_backend(q, q, q, **kw)  # type: ignore[arg-type]


def estimate_bytes(backend: str, n: int, K: int, cfg: Config) -> int:
    """Rough peak bytes of one forward + backward (inputs excluded)."""
    if backend == "auto":
        return max(estimate_bytes(b, n, K, cfg) for b in auto_picks(n, K, cfg))
    B, H, D = cfg.batch, cfg.heads, cfg.head_dim
    e = getattr(torch, cfg.dtype).itemsize
    bhnd = B * H * n * D * e
    if backend == "sdpa":
        return 6 * bhnd
    if backend in ("flash_regions", "decode"):
        return 12 * bhnd
    if backend in ("native", "triton"):  # out, lse, the gradients, O(n·R) per head
        return 8 * bhnd + 4 * B * H * n * (2 * K + 1) * e
    bhnn = B * H * n * n * e
    if backend == "bucketed":
        return 7 * bhnn + 8 * B * H * n * (2 * K + 1) * e
    # reference: (L, S, D) tables for keys and values, their gradients, and the score matrices
    return 4 * n * n * D * e + 6 * bhnn


def make_inputs(n: int, K: int, cfg: Config, seed: int = 0) -> dict[str, Any]:
    """Random inputs of one case: ``q``, ``k``, ``v`` ``(B, H, n, D)`` and the tables ``ak``,
    ``av`` ``(2K + 1, D)`` (all requiring grad), the upstream gradient ``grad``
    ``(B, H, n, D)`` and the ``causal`` flag; B, H, D, dtype and the flag from ``cfg``."""
    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator().manual_seed(seed)
    B, H, D = cfg.batch, cfg.heads, cfg.head_dim

    def rnd(*shape: int) -> Any:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)

    return dict(q=rnd(B, H, n, D), k=rnd(B, H, n, D), v=rnd(B, H, n, D),
                ak=rnd(2 * K + 1, D), av=rnd(2 * K + 1, D),
                grad=torch.randn(B, H, n, D, generator=g).to(dtype), causal=cfg.causal)


def _call(backend: str, x: dict[str, Any], K: int) -> Any:
    """One call of ``backend`` (a relpos backend, ``"auto"`` = ``implementation=None``, or
    ``"sdpa"``: no relative terms) on the inputs of :func:`make_inputs`."""
    from relpos.functional import relative_attention

    if backend == "sdpa":
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=x["causal"])
    return relative_attention(
        x["q"], x["k"], x["v"], max_distance=K, rel_keys=x["ak"], rel_values=x["av"],
        is_causal=x["causal"],
        implementation=None if backend == "auto" else backend,  # type: ignore[arg-type]
    )


def forward(backend: str, x: dict[str, Any], K: int) -> None:
    """The forward of ``backend`` (or ``"auto"``, ``"sdpa"``) under ``torch.no_grad``."""
    with torch.no_grad():
        _call(backend, x, K)


def forward_backward(backend: str, x: dict[str, Any], K: int) -> None:
    """The forward + backward of ``backend`` (or ``"auto"``, ``"sdpa"``), gradients reset
    first."""
    leaves = [x["q"], x["k"], x["v"]] + ([] if backend == "sdpa" else [x["ak"], x["av"]])
    for t in leaves:
        t.grad = None
    _call(backend, x, K).backward(x["grad"])


def _memory_case(backend: str, n: int, K: int, cfg: Config) -> Callable[[], None]:
    """In the memory subprocess: warm up kernels and thread pools at a small size, make the
    inputs; returns the forward + backward to measure."""
    small = make_inputs(64, min(K, 8), cfg)
    forward_backward(backend, small, min(K, 8))
    del small
    return functools.partial(forward_backward, backend, make_inputs(n, K, cfg), K)


def measure_memory(backend: str, n: int, K: int, cfg: Config, threads: int) -> float | str:
    """Peak MiB of one forward + backward in a fresh spawn subprocess (or an error string)."""
    return memory.peak_mib(functools.partial(_memory_case, backend, n, K, cfg), threads)


# ----------------------------------------------------------------------------------------------
# Running


def progress(total: int) -> tuple[Callable[[str], None], Callable[[], None]]:
    """``(tick, close)`` of a progress bar on stderr counting ``total`` calls (tqdm, an
    optional dependency; without it both do nothing)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is an optional dependency
        return (lambda label: None), (lambda: None)
    bar = tqdm(total=total, desc="bench", unit="call", file=sys.stderr, leave=False)

    def tick(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)

    return tick, bar.close


def _time_group(
    cases: list[tuple[Result, dict[str, Any]]], cfg: Config, tick: Callable[[str], None]
) -> None:
    """Time the cases of one sequence length in interleaved rounds (forward, then forward +
    backward, of each case in turn); each case gets its medians. A case whose call raises
    ``RuntimeError`` is marked failed."""

    def label(i: int, round_: int) -> None:
        r = cases[i][0]
        if round_ < cfg.warmup:
            tick(f"n={r.n} K={r.K} {r.backend} warm-up")
        else:
            tick(f"n={r.n} round {round_ - cfg.warmup + 1}/{cfg.repeats} K={r.K} {r.backend}")

    calls = {
        i: [functools.partial(fn, r.backend, x, r.K) for fn in (forward, forward_backward)]
        for i, (r, x) in enumerate(cases)
    }
    medians, failures = common.interleaved_medians(
        calls, warmup=cfg.warmup, repeats=cfg.repeats, tick=label, errors=(RuntimeError,)
    )
    for i, (r, _) in enumerate(cases):
        if i in failures:
            r.skipped = f"failed: {failures[i][:80]}"
        else:
            r.fwd_ms, r.fwdbwd_ms = medians[i]


def run_attention(args: argparse.Namespace) -> int:
    """Time every (n, K, backend) case, print a table and optionally write the report.

    Args:
        args: the ``relpos bench`` options (see ``relpos bench --help``): ``lengths``,
            ``max_distances``, ``batch``, ``heads``, ``head_dim``, ``dtype``, ``repeats``,
            ``warmup``, ``backends``, ``threads``, ``out``, ``quick``, ``memory``,
            ``memory_budget``, ``causal``; None = the default.

    Returns:
        0 (the exit status).
    """
    cfg = config(args)
    threads = common.use_threads(args.threads)
    clock = common.RunClock()
    budget_gib = getattr(args, "memory_budget", None)
    if budget_gib is not None and not budget_gib > 0:
        raise ValueError(f"--memory-budget must be a positive number of GiB, got {budget_gib}")
    budget = (int(0.6 * memory.available_bytes()) if budget_gib is None
              else int(budget_gib * 2**30))
    results: list[Result] = []
    groups: list[list[tuple[Result, dict[str, Any] | None]]] = []
    for n in cfg.lengths:
        group: list[tuple[Result, dict[str, Any] | None]] = []
        sdpa: Result | None = None
        for K in cfg.max_distances:
            for backend in cfg.backends:
                r = Result(n, K, backend)
                if backend == "auto":
                    fwd, both = auto_picks(n, K, cfg)
                    r.picks = fwd if fwd == both else f"{fwd} (fwd), {both} (fwd+bwd)"
                results.append(r)
                if backend == "sdpa" and sdpa is not None:  # SDPA has no K: once per n
                    group.append((r, None))
                    continue
                if (need := estimate_bytes(backend, n, K, cfg)) > budget:
                    r.skipped = f"skipped: would need {need / 2**30:.1f} GiB"
                else:
                    group.append((r, {}))
                    if backend == "sdpa":
                        sdpa = r
        groups.append(group)
    runnable = [len([1 for _, x in g if x is not None]) for g in groups]
    calls = sum(k * (cfg.warmup + cfg.repeats) for k in runnable)
    tick, close = progress(calls + (sum(runnable) if cfg.memory else 0))
    for group in groups:
        timed = [(r, y) for r, y in group if y is not None]
        by_K: dict[int, dict[str, Any]] = {}  # one set of inputs per K, shared by the backends
        for r, inputs in timed:
            if r.K not in by_K:
                by_K[r.K] = make_inputs(r.n, r.K, cfg)
            inputs.update(by_K[r.K])
        _time_group(timed, cfg, tick)
        for _, inputs in timed:
            inputs.clear()  # free the inputs before the memory subprocesses
        by_K.clear()
        for r, maybe in group:
            if maybe is None or r.skipped or not cfg.memory:
                continue
            tick(f"n={r.n} K={r.K} {r.backend} memory")
            mem = measure_memory(r.backend, r.n, r.K, cfg, threads)
            if isinstance(mem, str):
                r.skipped = mem[:80]
            else:
                r.peak_mib = mem
        first = next((r for r, y in group if r.backend == "sdpa" and y is not None), None)
        for r, maybe in group:
            if maybe is None and first is not None:
                r.fwd_ms, r.fwdbwd_ms = first.fwd_ms, first.fwdbwd_ms
                r.peak_mib, r.skipped = first.peak_mib, first.skipped
    close()
    print(_text_table(results))
    if args.out:
        md, csv, png_path = common.report_files(args.out, "attention")
        meta = _meta(args, cfg, threads, clock)
        wrote = common.write_files({md: _markdown(results, meta), csv: _csv(results)})
        png = _plot(results, png_path)
        if png is not None:
            wrote.append(png)
        print("wrote " + ", ".join(str(p) for p in wrote))
    return 0


# ----------------------------------------------------------------------------------------------
# Reporting


def _ratio(value: float | None, floor: float | None) -> float | None:
    if value is None or floor is None or floor <= 0:
        return None
    return value / floor


def _rows(results: list[Result]) -> list[dict[str, Any]]:
    floors = {(r.n, r.K): r for r in results if r.backend == "sdpa"}
    rows = []
    for r in results:
        f = floors.get((r.n, r.K))
        rows.append(dict(
            n=r.n, K=r.K, backend=r.backend, fwd_ms=r.fwd_ms,
            fwd_ratio=_ratio(r.fwd_ms, f.fwd_ms if f else None), fwdbwd_ms=r.fwdbwd_ms,
            fwdbwd_ratio=_ratio(r.fwdbwd_ms, f.fwdbwd_ms if f else None), peak_mib=r.peak_mib,
            mem_ratio=_ratio(r.peak_mib, f.peak_mib if f else None),
            note="; ".join(x for x in (f"picks {r.picks}" if r.picks else "", r.skipped) if x),
        ))
    return rows


_COLUMNS = (
    ("n", "n", "{}"), ("K", "K", "{}"), ("backend", "backend", "{}"),
    ("fwd_ms", "fwd ms", "{:.1f}"), ("fwd_ratio", "fwd / SDPA", "{:.2f}"),
    ("fwdbwd_ms", "fwd+bwd ms", "{:.1f}"), ("fwdbwd_ratio", "fwd+bwd / SDPA", "{:.2f}"),
    ("peak_mib", "peak MiB", "{:.1f}"), ("mem_ratio", "peak / SDPA", "{:.2f}"),
    ("note", "note", "{}"),
)
_TITLES = [title for _, title, _ in _COLUMNS]


def _cells(row: dict[str, Any]) -> list[str]:
    return ["-" if row[key] is None or row[key] == "" else fmt.format(row[key])
            for key, _, fmt in _COLUMNS]


def _text_table(results: list[Result]) -> str:
    rows = [_TITLES] + [_cells(r) for r in _rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _csv(results: list[Result]) -> str:
    def cell(value: Any) -> Any:
        return "" if value is None else (f"{value:.4g}" if isinstance(value, float) else value)

    return common.csv_text(
        [key for key, _, _ in _COLUMNS],
        ([cell(row[key]) for key, _, _ in _COLUMNS] for row in _rows(results)),
    )


def _effective_command(cfg: Config, threads: int, out: str | None) -> str:
    """The ``relpos bench`` command with every setting spelled out."""
    return (
        f"relpos bench --lengths {','.join(map(str, cfg.lengths))} --max-distances "
        f"{','.join(map(str, cfg.max_distances))} --batch {cfg.batch} --heads {cfg.heads} "
        f"--head-dim {cfg.head_dim} {cfg.timing_options()} --backends {','.join(cfg.backends)} "
        f"--threads {threads}"
        + ("" if cfg.memory else " --no-memory") + (" --causal" if cfg.causal else "")
        + (f" --out {out}" if out else "")
    )


def _meta(
    args: argparse.Namespace, cfg: Config, threads: int, clock: common.RunClock
) -> dict[str, str]:
    return {
        **common.command_header(args, _effective_command(cfg, threads, args.out), threads),
        "shape": f"B={cfg.batch}, H={cfg.heads}, D={cfg.head_dim}, self-attention (L = S = n), "
                 f"{cfg.dtype}, keys and values terms, shared tables, "
                 + ("causal" if cfg.causal else "not causal"),
        "timing": f"{cfg.warmup} warm-up call(s), then median of {cfg.repeats} rounds that run "
                  "every backend of one n in turn (interleaved, so a slow spell of the machine "
                  "hits all alike); forward under torch.no_grad(); fwd+bwd = forward + "
                  "backward of a random upstream gradient",
        "memory": MEMORY_METHOD if cfg.memory else "not measured (--no-memory)",
        **clock.meta(),
    }


def _markdown(results: list[Result], meta: dict[str, str]) -> str:
    lines = ["# relpos attention benchmark", "", *common.markdown_meta(meta), ""]
    lines += ["Ratios are to `F.scaled_dot_product_attention` without relative terms, "
              "measured in the same run.", ""]
    lines += common.markdown_table(_TITLES, (_cells(r) for r in _rows(results)))
    lines.append("")
    return "\n".join(lines)


def _figure(results: list[Result]) -> Any:
    """The figure of ``attention.png``: forward + backward time against n, a panel per K, a
    line per backend, one legend for all panels outside them on the right (inside, it would
    cover lines: sdpa, the reference every ratio is to, runs along the bottom right)."""
    from matplotlib.figure import Figure

    Ks = sorted({r.K for r in results})
    fig = Figure(figsize=(5 * len(Ks), 4))
    axes = fig.subplots(1, len(Ks), squeeze=False)
    for ax, K in zip(axes[0], Ks, strict=True):
        for backend in dict.fromkeys(r.backend for r in results):
            pts = [(r.n, r.fwdbwd_ms) for r in results
                   if r.K == K and r.backend == backend and r.fwdbwd_ms is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(f"K = {K}")
        ax.grid(True, which="both", alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.tight_layout()
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center left",
                   bbox_to_anchor=(1.0, 0.5), title="backend")
    return fig


def _plot(results: list[Result], path: Path) -> Path | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    from relpos._io import atomic_write

    fig = _figure(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    # "tight" takes in the legend outside the panels.
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=80,
                                                  bbox_inches="tight"))
    return path
