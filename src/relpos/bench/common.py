"""What the benchmarks share: interleaved timing rounds with medians, the report header
(date, command, hardware, instruction sets, versions, threads, OpenMP wait policy) and the
report files (CSV, markdown), written atomically.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from relpos import _sysinfo as sysinfo
from relpos._io import atomic_write_text

__all__ = [
    "DTYPES",
    "REPORT_SUFFIXES",
    "RunClock",
    "check_dtype",
    "check_names",
    "csv_text",
    "environment",
    "format_ms",
    "interleaved_medians",
    "markdown_meta",
    "markdown_table",
    "native_gemms",
    "report_date",
    "report_files",
    "script_command",
    "time_ms",
    "typed_command",
    "use_threads",
    "write_files",
]

#: The tensor dtypes the benchmarks run in, by the name the command line takes.
DTYPES = ("float32", "float64", "bfloat16")

CaseKey = TypeVar("CaseKey", bound=Hashable)


# ----------------------------------------------------------------------------------------------
# Settings


def check_names(
    option: str, value: str | Iterable[str], allowed: Sequence[str]
) -> tuple[str, ...]:
    """The names ``value`` gives (a comma-separated string or an iterable of names).

    Raises:
        ValueError: if it gives none, or one that is not in ``allowed``.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(n.strip() for n in items if n.strip())
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(
            f"{option}: unknown {unknown or list(names)!r}; allowed: {', '.join(allowed)}"
        )
    return names


@dataclass
class Timing:
    """How a run times each case: in ``dtype``, the median of ``repeats`` interleaved rounds
    after ``warmup`` untimed ones (``--dtype``, ``--repeats``, ``--warmup``)."""

    dtype: str
    repeats: int
    warmup: int

    def timing_options(self) -> str:
        """The options that ask for this timing, as a command spells them."""
        return f"--dtype {self.dtype} --repeats {self.repeats} --warmup {self.warmup}"


def timing(args: Any, *, repeats: int, quick_repeats: int = 2) -> dict[str, Any]:
    """The :class:`Timing` fields the options ``args`` ask for (read with ``getattr``; missing
    or None = the default: ``repeats`` rounds, ``quick_repeats`` with ``--quick``, 1 warm-up).

    Raises:
        ValueError: on a dtype not in :data:`DTYPES`, ``--repeats`` < 1 or ``--warmup`` < 0.
    """
    rounds = getattr(args, "repeats", None) or (
        quick_repeats if getattr(args, "quick", False) else repeats)
    warmup = getattr(args, "warmup", None)
    warmup = 1 if warmup is None else warmup
    if rounds < 1 or warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {rounds} and {warmup}")
    return {"dtype": check_dtype(getattr(args, "dtype", None)), "repeats": rounds,
            "warmup": warmup}


def add_timing_options(parser: argparse.ArgumentParser, *, repeats: int, warmup: int = 1) -> None:
    """The options a benchmark script times its cases by: ``--repeats`` (timed rounds; each
    case reports its median) and ``--warmup`` (untimed rounds before them)."""
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed rounds, each case's median reported (default {repeats})")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help=f"untimed rounds before them (default {warmup})")


def check_backends(value: str | Iterable[str], allowed: Sequence[str]) -> tuple[str, ...]:
    """The backends ``--backends`` names (:func:`check_names`); an old name of
    :data:`relpos.ops.RENAMED_BACKENDS` stands for its new one, with a DeprecationWarning
    (shown on the command line: ``relpos bench`` shows the warnings that start ``--backends``).
    """
    from relpos.ops import RENAMED_BACKENDS

    items = value.split(",") if isinstance(value, str) else list(value)
    names = []
    for name in (n.strip() for n in items):
        if name in RENAMED_BACKENDS and RENAMED_BACKENDS[name] in allowed:
            warnings.warn(f"--backends {name}: deprecated; use {RENAMED_BACKENDS[name]} (the "
                          f"same backend, renamed)", DeprecationWarning, stacklevel=2)
            name = RENAMED_BACKENDS[name]
        names.append(name)
    return check_names("--backends", names, allowed)


def check_dtype(value: str | None) -> str:
    """The ``--dtype`` name ``value`` gives (None = ``"float32"``).

    Raises:
        ValueError: if it is not one of :data:`DTYPES`.
    """
    dtype = str(value or "float32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def use_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (None = leave torch's default); returns
    the threads in use.

    Raises:
        ValueError: if ``threads`` is not positive.
    """
    import torch

    if threads is not None:
        if int(threads) <= 0:
            raise ValueError(f"--threads must be positive, got {threads}")
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------
# Timing


def time_ms(fn: Callable[[], object]) -> float:
    """Wall-clock milliseconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def interleaved_medians(
    cases: Mapping[CaseKey, Sequence[Callable[[], object]]],
    *,
    warmup: int,
    repeats: int,
    tick: Callable[[CaseKey, int], None] | None = None,
    errors: tuple[type[BaseException], ...] = (),
    rotate: bool = False,
) -> tuple[dict[CaseKey, tuple[float, ...]], dict[CaseKey, str]]:
    """Time the cases round-robin and take the median of the measured rounds.

    ``warmup`` unmeasured rounds, then ``repeats`` measured ones; every round calls each
    case's functions once, case after case, so a slow spell of a shared machine hits all
    cases alike and their ratios stay meaningful.

    Args:
        cases: case -> the functions timed for it, in order (for example forward, then
            forward + backward).
        warmup: unmeasured rounds first (>= 0).
        repeats: measured rounds (>= 1).
        tick: called as ``tick(case, round)`` before each case of each round (progress);
            rounds ``0..warmup-1`` are the warm-up.
        errors: exceptions that mark a case failed (it leaves the rounds); any other
            exception propagates.
        rotate: start round ``r`` at case ``r mod len(cases)`` (the order rotates), so that
            no case always runs right after the same one (a backend after SDPA, say).

    Returns:
        ``(medians, failures)``: case -> the median milliseconds of each of its functions,
        for the cases that ran through; case -> the first line of its error, for the others.
    """
    samples: dict[CaseKey, list[list[float]]] = {c: [[] for _ in fns] for c, fns in cases.items()}
    failures: dict[CaseKey, str] = {}
    order = list(cases)
    for round_ in range(warmup + repeats):
        start = round_ % len(order) if rotate and order else 0
        for case in order[start:] + order[:start]:
            fns = cases[case]
            if case in failures:
                continue
            if tick is not None:
                tick(case, round_)
            try:
                times = [time_ms(fn) for fn in fns]
            except errors as err:
                failures[case] = (str(err).splitlines() or [type(err).__name__])[0]
                continue
            if round_ >= warmup:
                for sample, ms in zip(samples[case], times, strict=True):
                    sample.append(ms)
    medians = {
        case: tuple(statistics.median(s) for s in samples[case])
        for case in cases
        if case not in failures
    }
    return medians, failures


# ----------------------------------------------------------------------------------------------
# Report header


@dataclass(frozen=True)
class RunClock:
    """When a run started and the machine's 1-minute load average then, for the ``load`` and
    ``duration`` lines of its report (:meth:`meta`)."""

    started: float = field(default_factory=time.time)
    load: float = field(default_factory=lambda: os.getloadavg()[0])

    def minutes(self) -> float:
        """Minutes since the start."""
        return (time.time() - self.started) / 60

    def meta(self) -> dict[str, str]:
        """``load`` (at the start and now) and ``duration`` (so far)."""
        return {
            "load": f"1-min load average {self.load:.2f} at start, "
                    f"{os.getloadavg()[0]:.2f} at end",
            "duration": f"{self.minutes():.1f} min",
        }


def report_date() -> str:
    """The current UTC time, as reports give it."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def environment(threads: int) -> dict[str, str]:
    """What every report header records about the machine and the software.

    ``hardware``: the CPU model (``model name`` of ``/proc/cpuinfo``, else
    ``platform.processor()``), the logical CPUs visible and the OS; ``ISA``: AVX2, AVX-512
    and AMX (``flags`` of ``/proc/cpuinfo``) and the instruction set torch's kernels use
    (``torch.backends.cpu.get_cpu_capability()``); the torch, relpos and Python versions;
    ``threads``: torch's intra-op threads; ``OMP_WAIT_POLICY``: its value or ``unset``
    (:mod:`relpos.bench.hardware` says why it matters); ``native GEMMs``:
    :func:`native_gemms`.
    """
    env = sysinfo.environment(threads)
    return {
        "hardware": sysinfo.hardware(),
        "ISA": f"{env['isa']}; torch CPU capability {env['torch_cpu_capability']}",
        "torch": env["torch"],
        "relpos": env["relpos"],
        "python": env["python"],
        "threads": str(threads),
        sysinfo.OMP_ENV: env["omp_wait_policy"],
        "native GEMMs": native_gemms(),
    }


def native_gemms() -> str:
    """What the native kernels this process loaded run each dtype's GEMMs on now, as they say
    (their ``gemm_engines()``: ``float32 vec, float64 blas, bfloat16 avx512bf16, float16
    widened``); where it loaded none, why: off, not built, or not used by this run."""
    from relpos.ops.native import build

    if build.disabled():
        return "off (RELPOS_NATIVE=0)"
    module = build.loaded()
    if module is None:
        failed = build.failure()
        return f"not built ({failed})" if failed else "not loaded (no native call in this run)"
    engines = build.gemm_engines(module)
    return ", ".join(f"{dtype} {engines[dtype]}" for dtype in
                     ("float32", "float64", "bfloat16", "float16") if dtype in engines)


def typed_command(args: argparse.Namespace) -> str | None:
    """The command line as typed: ``args.command_line`` if set, else this process's
    arguments when it is the ``relpos`` command; None otherwise (say, under pytest)."""
    typed = getattr(args, "command_line", None)
    program = Path(sys.argv[0])
    # ``relpos ...``, or ``python -m relpos ...`` (relpos/__main__.py), not ``python -m pytest``
    if typed is None and (program.name == "relpos" or (
            program.name == "__main__.py" and program.parent.name in ("relpos", "cli"))):
        typed = "relpos " + " ".join(sys.argv[1:])
    return typed


def command_header(args: argparse.Namespace, equivalent: str, threads: int) -> dict[str, str]:
    """How a ``relpos bench`` report begins: ``date``, ``command`` (as typed, else
    ``equivalent``), ``equivalent command`` (every setting spelled out) and the
    :func:`environment`."""
    return {
        "date": report_date(),
        "command": typed_command(args) or equivalent,
        "equivalent command": equivalent,
        **environment(threads),
    }


def script_command(module: str) -> str:
    """The command that starts the benchmark script ``module``, for a report's command line:
    ``python -m module`` (the arguments are the caller's to add)."""
    return f"python -m {module}"


# ----------------------------------------------------------------------------------------------
# Report files


#: The files of a report by its name, where not just markdown and CSV.
REPORT_SUFFIXES: dict[str, tuple[str, ...]] = {"attention": (".md", ".csv", ".png")}


def report_files(
    out: str | Path, name: str, suffixes: Sequence[str] | None = None, *, file_ok: bool = False,
) -> list[Path]:
    """The files the report ``name`` goes to with ``--out``: ``out/name.md``,
    ``out/name.csv``, ... (one per suffix, in order; None = the report's
    :data:`REPORT_SUFFIXES`, else markdown and CSV). With ``file_ok``, an ``out`` that ends in
    one of the suffixes names the files itself: ``x.md`` -> ``x.md``, ``x.csv``, ...

    Example:
        >>> [str(p) for p in report_files("r", "decode")]
        ['r/decode.md', 'r/decode.csv']
        >>> [str(p) for p in report_files("r/x.csv", "decode", file_ok=True)]
        ['r/x.md', 'r/x.csv']
    """
    if suffixes is None:
        suffixes = REPORT_SUFFIXES.get(name, (".md", ".csv"))
    path = Path(out)
    if file_ok and path.suffix.lower() in suffixes:
        return [path if path.suffix.lower() == suffix else path.with_suffix(suffix)
                for suffix in suffixes]
    return [path / f"{name}{suffix}" for suffix in suffixes]


def format_ms(ms: float) -> str:
    """Milliseconds with three significant digits or more, never in exponent notation:
    ``1234``, ``12.3``, ``1.23``, ``0.123``."""
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def markdown_meta(meta: Mapping[str, str]) -> list[str]:
    """One ``- **key**: value`` line per entry; commands in backticks."""
    return [f"- **{k}**: `{v}`" if "command" in k else f"- **{k}**: {v}" for k, v in meta.items()]


def markdown_table(
    head: Sequence[str], rows: Iterable[Sequence[str]], align: str = "---"
) -> list[str]:
    """The lines of a markdown table; ``align`` is every column's separator cell."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align for _ in head) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


def csv_text(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A CSV document (``\\n`` line ends) of a header and rows."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    writer.writerows(rows)
    return buf.getvalue()


def print_report(title: str, doc: str | None, meta: Mapping[str, str], body: Sequence[str],
                 out: Path | None, name: str) -> int:
    """Print a benchmark script's markdown report and, with ``out``, write it to
    ``out/name``: the title, the second paragraph of the script's docstring ``doc`` (what it
    measures), the header ``meta`` and the ``body`` lines. Returns 0 (the exit status)."""
    text = "\n".join([
        f"# {title}", "", " ".join((doc or "").split("\n\n")[1].split()), "",
        *markdown_meta(meta), "", *body, "",
    ])
    print(text)
    if out:
        write_files({out / name: text})
    return 0


def write_files(files: Mapping[Path, str]) -> list[Path]:
    """Write each text atomically (:func:`relpos._io.atomic_write_text`), making the
    directories first; returns the paths in order."""
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    return list(files)
