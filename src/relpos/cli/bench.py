"""``relpos bench``: time relpos backends against plain scaled dot-product attention.

For every sequence length n and clip distance K it times, in this one process, the forward
(under ``torch.no_grad``) and the forward + backward of each backend (``fused``,
``bucketed``, ``reference``) on self-attention with both relative terms, and of
``F.scaled_dot_product_attention`` without relative terms (the floor): warm-up calls, then
the median of measured rounds, each of which runs every backend of one n in turn, so that a
slow spell of a shared machine hits all backends alike. Peak memory of one forward + backward
is measured per case in a fresh ``spawn`` subprocess: peak RSS (``VmHWM``) minus the RSS
after the inputs were created. Cases that would not fit in memory are skipped with the estimate.

``relpos bench --decode`` runs the KV-cache decode benchmark instead
(:mod:`relpos.bench_decode`).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import importlib
import io
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relpos._io import atomic_write, atomic_write_text
from relpos._sysinfo import hardware
from relpos.cli import CLIError

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_MAX_DISTANCES = (16, 64)
QUICK_LENGTHS = (256, 512)
QUICK_MAX_DISTANCES = (16,)
BACKENDS = ("fused", "bucketed", "reference", "sdpa")
DTYPES = ("float32", "float64", "bfloat16")
MEMORY_METHOD = (
    "peak RSS (`VmHWM` of /proc/self/status, reset after the inputs were made) of a fresh "
    "`spawn` subprocess running one forward + backward, minus its RSS after creating the "
    "inputs and the upstream gradient"
)


def _int_list(name: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.replace(",", " ").split()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--{name} must be comma-separated integers, got {text!r}"
            ) from None
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"--{name} needs integers >= 0, got {text!r}")
        return values

    return parse


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def add_parser(subparsers: Any) -> None:
    """Register ``relpos bench``."""
    p = subparsers.add_parser(
        "bench",
        help="time relpos backends against plain SDPA (ms, ratio, peak memory)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--lengths", type=_int_list("lengths"), default=None,
                   help="sequence lengths n, comma-separated (default: 512,...,16384)")
    p.add_argument("--max-distances", type=_int_list("max-distances"), default=None,
                   help="clip distances K, comma-separated (default: 16,64)")
    p.add_argument("--batch", type=_positive, default=None, help="batch size B (default 1)")
    p.add_argument("--heads", type=_positive, default=None, help="heads H (default 8)")
    p.add_argument("--head-dim", type=_positive, default=None, help="head dim D (default 64)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default float32")
    p.add_argument("--repeats", type=_positive, default=None,
                   help="measured calls per case, median reported (default 3)")
    p.add_argument("--warmup", type=_non_negative, default=None,
                   help="warm-up calls per case (default 1)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(BACKENDS)} (default: all)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch threads (default: torch's default)")
    p.add_argument("--out", default=None,
                   help="directory for attention.md, attention.csv and attention.png")
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run (n=256,512, K=16, 1 warm-up, 2 repeats)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the per-case peak-memory subprocesses")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="skip cases whose estimated peak exceeds this many GiB "
                        "(default: 60%% of the available memory)")
    p.add_argument("--causal", action="store_true",
                   help="causal self-attention (is_causal=True) for every backend and SDPA")
    p.add_argument("--decode", action="store_true",
                   help="run the KV-cache decode benchmark instead")
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------------------------
# Cases


@dataclass
class Config:
    lengths: list[int]
    max_distances: list[int]
    batch: int
    heads: int
    head_dim: int
    dtype: str
    repeats: int
    warmup: int
    backends: list[str]
    memory: bool
    causal: bool = False


@dataclass
class Result:
    n: int
    K: int
    backend: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    peak_mib: float | None = None
    skipped: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def _config(args: argparse.Namespace) -> Config:
    quick = bool(getattr(args, "quick", False))
    backends = BACKENDS if args.backends is None else tuple(
        b.strip() for b in str(args.backends).split(",") if b.strip()
    )
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise CLIError(f"--backends: unknown {unknown}; allowed: {', '.join(BACKENDS)}")
    lengths = args.lengths or list(QUICK_LENGTHS if quick else DEFAULT_LENGTHS)
    if any(n < 1 for n in lengths):
        raise CLIError(f"--lengths must be positive, got {lengths}")
    return Config(
        lengths=lengths,
        max_distances=(args.max_distances if args.max_distances is not None
                       else list(QUICK_MAX_DISTANCES if quick else DEFAULT_MAX_DISTANCES)),
        batch=args.batch or 1,
        heads=args.heads or 8,
        head_dim=args.head_dim or 64,
        dtype=args.dtype or "float32",
        repeats=args.repeats or (2 if quick else 3),
        warmup=args.warmup if args.warmup is not None else 1,
        backends=list(backends),
        memory=bool(getattr(args, "memory", True)),
        causal=bool(getattr(args, "causal", False)),
    )


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float64": 8, "bfloat16": 2}[dtype]


def estimate_bytes(backend: str, n: int, K: int, cfg: Config) -> int:
    """Rough peak bytes of one forward + backward (inputs excluded)."""
    B, H, D, e = cfg.batch, cfg.heads, cfg.head_dim, _itemsize(cfg.dtype)
    bhnd = B * H * n * D * e
    if backend == "sdpa":
        return 6 * bhnd
    if backend == "fused":
        return 12 * bhnd
    bhnn = B * H * n * n * e
    if backend == "bucketed":
        return 7 * bhnn + 8 * B * H * n * (2 * K + 1) * e
    # reference: (L, S, D) tables for keys and values, their gradients, and the score matrices
    return 4 * n * n * D * e + 6 * bhnn


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _make_inputs(n: int, K: int, cfg: Config, seed: int = 0) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator().manual_seed(seed)
    B, H, D = cfg.batch, cfg.heads, cfg.head_dim

    def rnd(*shape: int) -> Any:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)

    return dict(q=rnd(B, H, n, D), k=rnd(B, H, n, D), v=rnd(B, H, n, D),
                ak=rnd(2 * K + 1, D), av=rnd(2 * K + 1, D),
                grad=torch.randn(B, H, n, D, generator=g).to(dtype), causal=cfg.causal)


def _call(backend: str, x: dict[str, Any], K: int) -> Any:
    import torch.nn.functional as F

    import relpos

    if backend == "sdpa":
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=x["causal"])
    return relpos.relative_attention(
        x["q"], x["k"], x["v"], max_distance=K, rel_keys=x["ak"], rel_values=x["av"],
        is_causal=x["causal"], implementation=backend,  # type: ignore[arg-type]
    )


def _fwd(backend: str, x: dict[str, Any], K: int) -> None:
    import torch

    with torch.no_grad():
        _call(backend, x, K)


def _fwdbwd(backend: str, x: dict[str, Any], K: int) -> None:
    leaves = [x["q"], x["k"], x["v"]] + ([] if backend == "sdpa" else [x["ak"], x["av"]])
    for t in leaves:
        t.grad = None
    _call(backend, x, K).backward(x["grad"])


def _timed_ms(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def _time_interleaved(
    cases: list[tuple[Result, dict[str, Any]]], cfg: Config, tick: Callable[[str], None]
) -> None:
    """Time the cases of one sequence length round-robin: each case's warm-up calls, then
    ``repeats`` rounds that run every case's forward and forward + backward once. A slow spell
    of a shared machine then hits every backend alike, so the ratios stay meaningful; each
    case reports its median. A case whose call raises ``RuntimeError`` is marked failed."""
    times: dict[int, tuple[list[float], list[float]]] = {id(r): ([], []) for r, _ in cases}
    live = list(cases)

    def attempt(r: Result, x: dict[str, Any], record: bool) -> None:
        try:
            fwd = _timed_ms(functools.partial(_fwd, r.backend, x, r.K))
            both = _timed_ms(functools.partial(_fwdbwd, r.backend, x, r.K))
        except RuntimeError as err:
            r.skipped = f"failed: {str(err).splitlines()[0][:80]}"
            live.remove((r, x))
            return
        if record:
            times[id(r)][0].append(fwd)
            times[id(r)][1].append(both)

    for r, x in list(live):
        for _ in range(cfg.warmup):
            if (r, x) in live:
                tick(f"n={r.n} K={r.K} {r.backend} warm-up")
                attempt(r, x, record=False)
    for i in range(cfg.repeats):
        for r, x in list(live):
            tick(f"n={r.n} round {i + 1}/{cfg.repeats} K={r.K} {r.backend}")
            attempt(r, x, record=True)
    for r, _ in live:
        fwd, both = times[id(r)]
        r.fwd_ms, r.fwdbwd_ms = statistics.median(fwd), statistics.median(both)


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss_peak_bytes() -> int:
    """Peak RSS of this process: ``VmHWM`` (per address space, so not inherited from the
    parent like ``ru_maxrss`` is across fork + exec), else ``ru_maxrss``."""
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def _reset_peak() -> None:
    """Reset the peak RSS to the current RSS where the kernel allows it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
    except OSError:
        pass


def _memory_worker(backend: str, n: int, K: int, cfg: Config, threads: int, queue: Any) -> None:
    """Subprocess body: peak RSS increase of one forward + backward."""
    try:
        import torch

        torch.set_num_threads(threads)
        small = _make_inputs(64, min(K, 8), cfg)  # initialize kernels and thread pools
        _fwdbwd(backend, small, min(K, 8))
        del small
        x = _make_inputs(n, K, cfg)
        _reset_peak()
        base = max(_rss_peak_bytes(), 1024 * (_proc_status_kib("VmRSS") or 0))
        _fwdbwd(backend, x, K)
        queue.put((_rss_peak_bytes() - base) / 2**20)
    except BaseException as err:  # reported in the table, not raised across processes
        queue.put(f"error: {type(err).__name__}: {err}")


def measure_memory(backend: str, n: int, K: int, cfg: Config, threads: int) -> float | str:
    """Peak MiB of one forward + backward in a fresh spawn subprocess (or an error string)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_memory_worker, args=(backend, n, K, cfg, threads, queue))
    proc.start()
    try:
        value = queue.get()
    finally:
        proc.join()
    return value


# ----------------------------------------------------------------------------------------------
# Running


def run(args: argparse.Namespace) -> int:
    """``relpos bench``: run the attention benchmark (or the decode one with ``--decode``)."""
    if getattr(args, "decode", False):
        try:
            decode = importlib.import_module("relpos.bench_decode")
        except ModuleNotFoundError as err:
            raise CLIError("--decode is not available in this build") from err
        return int(decode.run_decode(args) or 0)
    return run_attention(args)


def run_attention(args: argparse.Namespace) -> int:
    """Time every (n, K, backend) case, print a table and optionally write the report."""
    import torch

    from relpos import available_backends

    cfg = _config(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    have = set(available_backends()) | {"sdpa"}
    load_start = os.getloadavg()
    started = time.time()
    budget_gib = getattr(args, "memory_budget", None)
    if budget_gib is not None and not budget_gib > 0:
        raise CLIError(f"--memory-budget must be a positive number of GiB, got {budget_gib}")
    budget = int(0.6 * _available_bytes()) if budget_gib is None else int(budget_gib * 2**30)
    results: list[Result] = []
    groups: list[list[tuple[Result, dict[str, Any] | None]]] = []
    for n in cfg.lengths:
        group: list[tuple[Result, dict[str, Any] | None]] = []
        sdpa: Result | None = None
        for K in cfg.max_distances:
            for backend in cfg.backends:
                r = Result(n, K, backend)
                results.append(r)
                if backend == "sdpa" and sdpa is not None:  # SDPA has no K: once per n
                    group.append((r, None))
                    continue
                if backend not in have:
                    r.skipped = "skipped: backend not available in this build"
                elif (need := estimate_bytes(backend, n, K, cfg)) > budget:
                    r.skipped = f"skipped: would need {need / 2**30:.1f} GiB"
                else:
                    group.append((r, {}))
                    if backend == "sdpa":
                        sdpa = r
        groups.append(group)
    runnable = [len([1 for _, x in g if x is not None]) for g in groups]
    calls = sum(k * (cfg.warmup + cfg.repeats) for k in runnable)
    total = calls + (sum(runnable) if cfg.memory else 0)
    try:
        from tqdm import tqdm

        bar: Any = tqdm(total=total, desc="bench", unit="call", file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover - tqdm is an optional dependency
        bar = None

    def tick(label: str) -> None:
        if bar is not None:
            bar.set_postfix_str(label)
            bar.update(1)

    for group in groups:
        timed = [(r, y) for r, y in group if y is not None]
        by_K: dict[int, dict[str, Any]] = {}  # one set of inputs per K, shared by the backends
        for r, inputs in timed:
            if r.K not in by_K:
                by_K[r.K] = _make_inputs(r.n, r.K, cfg)
            inputs.update(by_K[r.K])
        _time_interleaved(timed, cfg, tick)
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
    if bar is not None:
        bar.close()
    elapsed = time.time() - started
    table = _text_table(results)
    print(table)
    if args.out:
        out = Path(args.out)
        meta = _meta(args, cfg, threads, load_start, os.getloadavg(), elapsed)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "attention.csv", _csv(results))
        atomic_write_text(out / "attention.md", _markdown(results, meta))
        wrote = [out / "attention.md", out / "attention.csv"]
        png = _plot(results, out / "attention.png")
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
            mem_ratio=_ratio(r.peak_mib, f.peak_mib if f else None), note=r.skipped,
        ))
    return rows


_COLUMNS = (
    ("n", "n", "{}"), ("K", "K", "{}"), ("backend", "backend", "{}"),
    ("fwd_ms", "fwd ms", "{:.1f}"), ("fwd_ratio", "fwd / SDPA", "{:.2f}"),
    ("fwdbwd_ms", "fwd+bwd ms", "{:.1f}"), ("fwdbwd_ratio", "fwd+bwd / SDPA", "{:.2f}"),
    ("peak_mib", "peak MiB", "{:.1f}"), ("mem_ratio", "peak / SDPA", "{:.2f}"),
    ("note", "note", "{}"),
)


def _cells(row: dict[str, Any]) -> list[str]:
    return ["-" if row[key] is None or row[key] == "" else fmt.format(row[key])
            for key, _, fmt in _COLUMNS]


def _text_table(results: list[Result]) -> str:
    rows = [[title for _, title, _ in _COLUMNS]] + [_cells(r) for r in _rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _csv(results: list[Result]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([key for key, _, _ in _COLUMNS])
    for row in _rows(results):
        writer.writerow(["" if row[k] is None else (f"{row[k]:.4g}" if isinstance(row[k], float)
                                                    else row[k]) for k, _, _ in _COLUMNS])
    return buf.getvalue()


def _meta(
    args: argparse.Namespace, cfg: Config, threads: int, load_start: tuple[float, ...],
    load_end: tuple[float, ...], elapsed: float,
) -> dict[str, str]:
    import torch

    from relpos import __version__

    effective = (
        f"relpos bench --lengths {','.join(map(str, cfg.lengths))} --max-distances "
        f"{','.join(map(str, cfg.max_distances))} --batch {cfg.batch} --heads {cfg.heads} "
        f"--head-dim {cfg.head_dim} --dtype {cfg.dtype} --repeats {cfg.repeats} "
        f"--warmup {cfg.warmup} --backends {','.join(cfg.backends)} --threads {threads}"
        + ("" if cfg.memory else " --no-memory") + (" --causal" if cfg.causal else "")
        + (f" --out {args.out}" if args.out else "")
    )
    typed = getattr(args, "command_line", None)
    if typed is None and Path(sys.argv[0]).name in ("relpos", "__main__.py"):
        typed = "relpos " + " ".join(sys.argv[1:])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": typed or effective,
        "equivalent command": effective,
        "hardware": hardware(),
        "torch": torch.__version__,
        "relpos": __version__,
        "python": platform.python_version(),
        "threads": str(threads),
        "shape": f"B={cfg.batch}, H={cfg.heads}, D={cfg.head_dim}, self-attention (L = S = n), "
                 f"{cfg.dtype}, keys and values terms, shared tables, "
                 + ("causal" if cfg.causal else "not causal"),
        "timing": f"{cfg.warmup} warm-up call(s), then median of {cfg.repeats} rounds that run "
                  "every backend of one n in turn (interleaved, so a slow spell of the machine "
                  "hits all alike); forward under torch.no_grad(); fwd+bwd = forward + "
                  "backward of a random upstream gradient",
        "memory": MEMORY_METHOD if cfg.memory else "not measured (--no-memory)",
        "load": f"1-min load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end",
        "duration": f"{elapsed / 60:.1f} min",
    }


def _markdown(results: list[Result], meta: dict[str, str]) -> str:
    lines = ["# relpos attention benchmark", ""]
    lines += [f"- **{k}**: `{v}`" if "command" in k else f"- **{k}**: {v}"
              for k, v in meta.items()]
    lines += ["", "Ratios are to `F.scaled_dot_product_attention` without relative terms, "
              "measured in the same run.", ""]
    lines.append("| " + " | ".join(title for _, title, _ in _COLUMNS) + " |")
    lines.append("|" + "|".join("---" for _ in _COLUMNS) + "|")
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in _rows(results)]
    lines.append("")
    return "\n".join(lines)


def _plot(results: list[Result], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    Ks = sorted({r.K for r in results})
    fig, axes = plt.subplots(1, len(Ks), figsize=(5 * len(Ks), 4), squeeze=False)
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
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=80))
    finally:
        plt.close(fig)
    return path
