"""The native kernels' performance targets, checked against benchmark reports.

A script of the repository, not of the installed package: it judges the reports committed
under ``benchmarks/`` (or those ``--run`` writes) and runs with relpos installed, from the
repository root::

    python benchmarks/last_mile.py --run DIR

Reads the CSV files the benchmarks write and says, target by target, the cells it checked,
the worst of them and whether the target is met; every cell that misses is listed. With
``--run DIR`` it first measures everything on this machine (about 15 minutes on 2 cores;
each benchmark in a subprocess with ``OMP_WAIT_POLICY=PASSIVE``) into ``DIR``, then checks
``DIR``. Exit status 0 when every checked target is met, 1 when one is missed, 2 on bad
input.

The targets (ratios to ``F.scaled_dot_product_attention`` without relative terms, measured
in the same run; L = S = n, R = 2K + 1):

* float32 forward and forward + backward (``--training``: ``relpos bench --preset training``;
  ``--attention``: ``relpos bench``, every ``native`` and ``auto`` row): <= 1.2x where
  K <= n/4; where the window covers most offsets (K >= n/4), <= 1.1x the FLOP floor
  ``1 + min(R, L + S - 1) / S`` (met by either where K = n/4);
* peak memory of forward + backward at n = 16384, K = 64 (``--attention``): <= 1.1x SDPA's;
* bfloat16 forward and forward + backward (``--bf16``: the training preset in bfloat16):
  <= 1.2x bfloat16 SDPA at n >= 256, <= 1.4x below; and faster than the same cell in
  float32 (``--training``) where the CPU has bfloat16 GEMMs (AMX-BF16 or AVX512-BF16; this
  machine's flags, or ``--bf16-gemms``);
* decoding against CTranslate2 float32 (``--decode``: ``python -m relpos.bench.ct2_decode``):
  <= 1.0x at batch 1, <= 0.8x at batch 8, at each thread count, with the same tokens. Where
  the native kernels' decode panels are built but not the CPU's default packing (Intel's:
  MKL), ``--run`` also decodes with ``RELPOS_DECODE_PACKING=relpos`` (``--decode-panels``),
  judged the same way as an alternative, outside the exit status.

The committed AMD EPYC reports, judged::

    python benchmarks/last_mile.py --training benchmarks/training_shapes_epyc.csv \\
        --bf16 benchmarks/training_shapes_epyc_bf16.csv \\
        --attention benchmarks/attention_epyc.csv --decode benchmarks/ct2_decode_epyc.csv
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relpos.bench.common import markdown_table, report_date, write_files

#: K <= n/4: at most this many times SDPA's time (float32).
FP32_LIMIT = 1.2
#: K >= n/4: at most this many times the FLOP floor.
FLOOR_LIMIT = 1.1
#: Peak memory of forward + backward at MEMORY_CELL, times SDPA's.
MEMORY_LIMIT = 1.1
MEMORY_CELL = (16384, 64)  # (n, K)
#: bfloat16: at most this many times bfloat16 SDPA's time at n >= 256, and below.
BF16_LIMIT, BF16_SHORT_LIMIT = 1.2, 1.4
#: Decoding: at most this many times CTranslate2 float32's time per token, by batch.
DECODE_LIMITS = {1: 1.0, 8: 0.8}
CHECKED_BACKENDS = ("auto", "native")


def flop_floor(n: int, k: int) -> float:
    """The FLOP floor of self-attention of length n with 2K + 1 relative rows against SDPA:
    ``1 + min(R, L + S - 1) / S`` (L = S = n)."""
    return 1 + min(2 * k + 1, 2 * n - 1) / n


@dataclass
class Target:
    """One target: what it says, the cells checked (label, value, limit) and the misses."""

    text: str
    source: str
    cells: list[tuple[str, float, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # e.g. tokens that disagree
    #: a setting that is not this CPU's default, judged for the record, not in the exit status
    alternative: bool = False

    def add(self, label: str, value: float, limit: float) -> None:
        """One cell; ``label`` names it (and its report, where the target reads several)."""
        self.cells.append((label, value, limit))

    @property
    def misses(self) -> list[tuple[str, float, float]]:
        return [c for c in self.cells if c[1] > c[2]]

    @property
    def met(self) -> bool | None:
        if not self.cells:
            return None
        return not self.misses and not self.problems

    def worst(self) -> str:
        if not self.cells:
            return "-"
        label, value, limit = max(self.cells, key=lambda c: c[1] / c[2])
        return f"{value:.2f}x (limit {limit:.2f}) at {label}"


class CheckError(Exception):
    """A report that cannot be read as the option says, or a measurement that failed."""


def _rows(path: Path, needs: Sequence[str], option: str) -> list[dict[str, str]]:
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as error:
        raise CheckError(f"{option} {path}: {error.strerror or error}") from None
    header = set(rows[0]) if rows else set()
    missing = [c for c in needs if c not in header]
    if not rows or missing:
        raise CheckError(f"{option} {path}: not the CSV of that report (needs the columns "
                         f"{', '.join(needs)}; {'it has no rows' if not rows else 'missing '}"
                         f"{', '.join(missing)})")
    return rows


def _number(row: dict[str, str], column: str, option: str, path: Path) -> float | None:
    text = (row.get(column) or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise CheckError(f"{option} {path}: column {column} holds {text!r}, not a "
                         "number") from None


def _int(row: dict[str, str], column: str, option: str, path: Path) -> int:
    value = _number(row, column, option, path)
    if value is None or value != int(value):
        raise CheckError(f"{option} {path}: column {column} holds {row.get(column)!r}, not "
                         "a whole number")
    return int(value)


def _fp32_limit(n: int, k: int) -> tuple[float, str]:
    """The limit of a float32 cell and how it reads: 1.2x where K <= n/4, else (and where
    that is higher at K = n/4) 1.1x the FLOP floor."""
    floor = FLOOR_LIMIT * flop_floor(n, k)
    if 4 * k < n:
        return FP32_LIMIT, ""
    if 4 * k > n:
        return floor, f", floor {flop_floor(n, k):.2f}"
    return max(FP32_LIMIT, floor), f", K = n/4, floor {flop_floor(n, k):.2f}"


TRAINING_COLUMNS = ("B", "n", "K", "causal", "pass", "backend", "ms", "over_sdpa")


def _training_cells(path: Path, option: str) -> dict[tuple[int, int, int, bool, str],
                                                     tuple[float, float]]:
    """(B, n, K, causal, pass) -> (ms, ratio to SDPA) of the checked backends' rows."""
    cells = {}
    for row in _rows(path, TRAINING_COLUMNS, option):
        if row["backend"] not in CHECKED_BACKENDS or not row["K"].strip():
            continue
        ms, ratio = (_number(row, c, option, path) for c in ("ms", "over_sdpa"))
        if ms is None or ratio is None:
            continue
        causal = row["causal"].strip() in ("1", "True")
        b, n, k = (_int(row, c, option, path) for c in ("B", "n", "K"))
        cells[b, n, k, causal, row["pass"]] = (ms, ratio)
    if not cells:
        raise CheckError(f"{option} {path}: no rows of the {' or '.join(CHECKED_BACKENDS)} "
                         "backends to check")
    return cells


def _label(b: int | None, n: int, k: int, causal: bool, pass_: str) -> str:
    shape = f"{b} x {n}" if b is not None else f"n = {n}"
    return f"{shape}, K = {k}{', causal' if causal else ''}, {pass_}"


def check_training(path: Path) -> list[Target]:
    fwd = Target(f"float32 forward <= {FP32_LIMIT}x SDPA where K <= n/4, else <= "
                 f"{FLOOR_LIMIT}x the FLOP floor", _short(path))
    both = Target("float32 forward + backward, the same limits", _short(path))
    cells = _training_cells(path, "--training")
    for (b, n, k, causal, pass_), (_, ratio) in sorted(cells.items()):
        limit, note = _fp32_limit(n, k)
        (fwd if pass_ == "fwd" else both).add(_label(b, n, k, causal, pass_) + note, ratio, limit)
    return [fwd, both]


ATTENTION_COLUMNS = ("n", "K", "backend", "fwd_ratio", "fwdbwd_ratio", "mem_ratio")


def check_attention(paths: Iterable[Path]) -> list[Target]:
    paths = list(paths)
    names = ", ".join(_short(p) for p in paths)
    speed = Target("float32 (held-out shapes) forward and forward + backward, the same "
                   "limits", names)
    memory = Target(f"peak memory of forward + backward at n = {MEMORY_CELL[0]}, "
                    f"K = {MEMORY_CELL[1]} <= {MEMORY_LIMIT}x SDPA's", names)
    for path in paths:
        where = f" ({_short(path)})" if len(paths) > 1 else ""
        for row in _rows(path, ATTENTION_COLUMNS, "--attention"):
            if row["backend"] not in CHECKED_BACKENDS:
                continue
            n, k = (_int(row, c, "--attention", path) for c in ("n", "K"))
            limit, note = _fp32_limit(n, k)
            for column, pass_ in (("fwd_ratio", "fwd"), ("fwdbwd_ratio", "fwd+bwd")):
                ratio = _number(row, column, "--attention", path)
                if ratio is not None:
                    speed.add(f"{_label(None, n, k, False, pass_)}{note}{where}", ratio, limit)
            mem = _number(row, "mem_ratio", "--attention", path)
            if (n, k) == MEMORY_CELL and mem is not None:
                memory.add(f"n = {n}, K = {k}{where}", mem, MEMORY_LIMIT)
    return [speed, memory]


def check_bf16(path: Path, fp32: Path | None, bf16_gemms: bool) -> list[Target]:
    cells = _training_cells(path, "--bf16")
    limits = Target(f"bfloat16 forward and forward + backward <= {BF16_LIMIT}x bfloat16 SDPA "
                    f"at n >= 256, <= {BF16_SHORT_LIMIT}x below", _short(path))
    for (b, n, k, causal, pass_), (_, ratio) in sorted(cells.items()):
        limits.add(_label(b, n, k, causal, pass_),
                   ratio, BF16_LIMIT if n >= 256 else BF16_SHORT_LIMIT)
    targets = [limits]
    if fp32 is not None:
        against = Target("bfloat16 faster than the same cell in float32 "
                         + ("(this CPU has bfloat16 GEMMs)" if bf16_gemms else
                            "(not a target here: no bfloat16 GEMMs)"),
                         f"{_short(path)} / {_short(fp32)}")
        if bf16_gemms:
            base = _training_cells(fp32, "--training")
            for key, (ms, _) in sorted(cells.items()):
                if key in base:
                    against.add(_label(*key) + " bf16 / fp32 time", ms / base[key][0], 1.0)
        targets.append(against)
    return targets


DECODE_COLUMNS = ("case", "batch", "threads", "relpos", "ct2_f32", "agree")


def check_decode(path: Path, option: str = "--decode") -> list[Target]:
    """The decode target; ``option`` ``--decode-panels``: a run on the native panels where
    they are not the CPU's default (an alternative, out of the exit status)."""
    alternative = option == "--decode-panels"
    target = Target(("with RELPOS_DECODE_PACKING=relpos (not this CPU's default): "
                     if alternative else "") + "decoding against CTranslate2 float32: "
                    + ", ".join(f"<= {v}x at batch {b}" for b, v in DECODE_LIMITS.items()),
                    _short(path), alternative=alternative)
    for row in _rows(path, DECODE_COLUMNS, option):
        if row["case"] != "decode":
            continue
        batch, threads = (_int(row, c, option, path) for c in ("batch", "threads"))
        ours, theirs = (_number(row, c, option, path) for c in ("relpos", "ct2_f32"))
        if ours is None or not theirs or batch not in DECODE_LIMITS:
            continue
        label = f"batch {batch}, {threads} thread{'' if threads == 1 else 's'}"
        target.add(label, ours / theirs, DECODE_LIMITS[batch])
        if row["agree"].strip() != "True":
            target.problems.append(f"{label}: the tokens differ from CTranslate2's")
    return [target]


def has_bf16_gemms() -> bool:
    """Whether this CPU has bfloat16 GEMMs (AMX-BF16 or AVX512-BF16)."""
    from relpos._sysinfo import cpu_flags

    return bool({"amx_bf16", "avx512_bf16"} & (cpu_flags() or frozenset()))


def _short(path: Path) -> str:
    """``parent/name``: the reports of ``--run`` share their names (fp32/training.csv)."""
    return path.name if path.parent.name in ("", ".") else f"{path.parent.name}/{path.name}"


#: The header lines of a benchmark report that say where it ran, as (key, how to write it).
MACHINE_KEYS = (("hardware", "{}"), ("ISA", "{}"), ("torch", "torch {}"),
                ("threads", "threads {}"), ("OMP_WAIT_POLICY", "OMP_WAIT_POLICY={}"))


def machines(csvs: Iterable[Path]) -> list[tuple[str, str]]:
    """(report, where it ran) for each CSV, read from the header of the markdown report
    beside it (same name, ``.md``): the machine, its ISA, torch, threads and OpenMP wait
    policy; "not said" where there is none."""
    found = []
    for path in csvs:
        meta: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for text in path.with_suffix(".md").read_text(encoding="utf-8").splitlines():
                if text.startswith("- **") and "**: " in text:
                    key, value = text[4:].split("**: ", 1)
                    meta.setdefault(key, value.strip())
        said = [form.format(meta[key]) for key, form in MACHINE_KEYS if key in meta]
        found.append((_short(path), "; ".join(said) if "hardware" in meta else
                      "not said (no markdown report beside the CSV names its machine)"))
    return found


def report(targets: Sequence[Target]) -> str:
    """The markdown: one row per target, then every miss."""
    def verdict(t: Target) -> str:
        said = {None: "not measured", True: "met", False: "**missed**"}[t.met]
        return f"{said} (an alternative: not in the exit status)" if t.alternative else said

    lines = markdown_table(
        ["target", "report", "cells", "worst (value / limit)", ""],
        [[t.text, t.source, str(len(t.cells)), t.worst(), verdict(t)] for t in targets])
    misses = [(t, c) for t in targets for c in t.misses]
    problems = [p for t in targets for p in t.problems]
    if misses or problems:
        lines += ["", "Missed:", ""]
        lines += [f"- {c[0]}: {c[1]:.2f}x, limit {c[2]:.2f}x"
                  # (a target over several reports names each cell's in its label)
                  + ("" if ", " in t.source else f" ({t.source})") for t, c in misses]
        lines += [f"- {p}" for p in problems]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# --run: measure on this machine, then check


def panels_are_an_alternative() -> bool:
    """Whether the native kernels' decode panels are built with their vector code here but
    are not this CPU's default packing (Intel's: MKL), and no packing is asked for: then
    ``--run`` times the decoding both ways."""
    from relpos.models.decoding import PACKING_ENV, decode_packing

    if os.environ.get(PACKING_ENV) or decode_packing() == "relpos":
        return False
    from relpos.ops.native import build

    module = build.load(quiet=True)
    return module is not None and build.build_facts(module).get("vectors", "none") != "none"


Command = tuple[str, list[str], dict[str, str]]  # name, argv after ``python``, environment


def run_commands(out: Path, *, quick: bool = False) -> list[Command]:
    """The measurements ``--run`` makes, as (name, argv after ``python``, variables added to
    the environment); ``quick``: tiny shapes and one round, to try the pipeline (no figure
    to keep)."""
    relpos = ["-m", "relpos", "bench", "--omp-wait-policy", "passive"]
    if quick:
        shapes = ["--tokens", "256", "--lengths", "64,128", "--max-distances", "16,64",
                  "--repeats", "1", "--warmup", "0", "--no-memory"]
        long = ["--lengths", "256", "--max-distances", "64", "--repeats", "1", "--warmup", "0",
                "--no-memory"]
        held = ["--lengths", "100", "--batch", "2", "--head-dim", "32", "--max-distances", "8",
                "--repeats", "1", "--warmup", "0", "--no-memory"]
        decode = ["--layers", "1", "--d-model", "64", "--heads", "2", "--new-tokens", "4",
                  "--prompt", "4", "--threads", "1", "--repeats", "1", "--warmup", "0",
                  "--forward-length", "0"]
    else:
        shapes = ["--repeats", "5"]
        long = ["--lengths", "8192,16384", "--max-distances", "64", "--repeats", "3"]
        held = ["--lengths", "333", "--batch", "12", "--head-dim", "32", "--max-distances",
                "32", "--repeats", "7"]
        decode = ["--repeats", "3"]
    commands: list[Command] = [
        ("training", [*relpos, "--preset", "training", "--backends", "auto", *shapes,
                      "--out", str(out / "fp32")], {}),
        ("bf16", [*relpos, "--preset", "training", "--backends", "auto", "--dtype", "bfloat16",
                  *shapes, "--out", str(out / "bf16")], {}),
        ("long", [*relpos, "--backends", "native,sdpa", *long, "--out", str(out / "long")], {}),
        ("held-out", [*relpos, "--backends", "native,sdpa", *held, "--out", str(out / "held")],
         {}),
        ("held-out causal", [*relpos, "--backends", "native,sdpa", *held, "--causal",
                             "--out", str(out / "held_causal")], {}),
    ]
    if importlib.util.find_spec("ctranslate2") is not None:
        ct2 = ["-m", "relpos.bench.ct2_decode", *decode]
        commands.append(("decode", [*ct2, "--out", str(out / "ct2_decode.md")], {}))
        if panels_are_an_alternative():
            commands.append(("decode on the panels",
                             [*ct2, "--out", str(out / "ct2_decode_panels.md")],
                             {"RELPOS_DECODE_PACKING": "relpos"}))
    return commands


def measure(out: Path, *, quick: bool = False) -> None:
    """Run :func:`run_commands` one after the other, saying which; raises on a failure."""
    commands = run_commands(out, quick=quick)
    for i, (name, argv, extra) in enumerate(commands, 1):
        shown = " ".join([*(f"{k}={v}" for k, v in extra.items()), "python", *argv])
        print(f"relpos: last mile: [{i}/{len(commands)}] {name}: {shown}", file=sys.stderr,
              flush=True)
        done = subprocess.run([sys.executable, *argv],
                              env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **extra},
                              stdout=subprocess.DEVNULL, check=False)
        if done.returncode:
            raise CheckError(f"the {name} measurement failed (exit {done.returncode}): "
                             f"{shown}")
    if not any(name == "decode" for name, _, _ in commands):
        print("relpos: last mile: ctranslate2 is not installed: the decode target is not "
              "measured (pip install 'relpos[ct2]')", file=sys.stderr, flush=True)


#: Environment variables that change what a measurement runs (recorded by ``--run``): the
#: kernels relpos loads and how, torch's, MKL's, oneDNN's and CTranslate2's instruction sets.
SETTINGS = ("RELPOS_NATIVE", "RELPOS_KERNELS_DIR", "RELPOS_NATIVE_FLOAT_GEMM",
            "RELPOS_NATIVE_BF16_GEMM", "RELPOS_DECODE_PACKING",
            "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
            "CT2_FORCE_CPU_ISA")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--run", type=Path, metavar="DIR",
                   help="measure everything on this machine into DIR, then check DIR")
    p.add_argument("--quick", action="store_true",
                   help="with --run: tiny shapes, one round (tries the pipeline; no figure to "
                        "keep)")
    p.add_argument("--training", type=Path, metavar="CSV",
                   help="relpos bench --preset training (float32) CSV")
    p.add_argument("--bf16", type=Path, metavar="CSV",
                   help="relpos bench --preset training --dtype bfloat16 CSV")
    p.add_argument("--attention", type=Path, metavar="CSV", action="append", default=[],
                   help="relpos bench CSV (held-out shapes, memory); repeatable")
    p.add_argument("--decode", type=Path, metavar="CSV",
                   help="python -m relpos.bench.ct2_decode CSV")
    p.add_argument("--decode-panels", type=Path, metavar="CSV",
                   help="python -m relpos.bench.ct2_decode CSV with "
                        "RELPOS_DECODE_PACKING=relpos where that is not the CPU's default "
                        "(judged; not in the exit status)")
    p.add_argument("--bf16-gemms", choices=("yes", "no"),
                   help="whether the measured CPU has bfloat16 GEMMs (default: this CPU's "
                        "flags)")
    p.add_argument("--out", type=Path, metavar="MD",
                   help="write the table to this markdown file too (with --run: DIR/targets.md)")
    args = p.parse_args(argv)
    given = (args.training, args.bf16, args.attention, args.decode, args.decode_panels)
    if args.quick and args.run is None:
        p.error("--quick goes with --run DIR")
    if args.run is None and not any(given):
        p.error("nothing to check: pass --run DIR, or one or more of --training, --bf16, "
                "--attention, --decode, --decode-panels")
    if args.run is not None and any(given):
        p.error("--run DIR measures its own reports; --training, --bf16, --attention, "
                "--decode and --decode-panels check reports already written")
    try:
        if args.run is not None:
            if args.run.exists() and not args.run.is_dir():
                raise CheckError(f"--run {args.run}: that is a file, not a directory")
            measure(args.run, quick=args.quick)
            args.training = args.run / "fp32" / "training.csv"
            args.bf16 = args.run / "bf16" / "training.csv"
            args.attention = [args.run / d / "attention.csv"
                              for d in ("long", "held", "held_causal")]
            decode, panels = args.run / "ct2_decode.csv", args.run / "ct2_decode_panels.csv"
            args.decode = decode if decode.exists() else None
            args.decode_panels = panels if panels.exists() else None
            args.out = args.out or args.run / "targets.md"
        gemms = has_bf16_gemms() if args.bf16_gemms is None else args.bf16_gemms == "yes"
        targets: list[Target] = []
        if args.training:
            targets += check_training(args.training)
        if args.attention:
            targets += check_attention(args.attention)
        if args.bf16:
            targets += check_bf16(args.bf16, args.training, gemms)
        if args.decode:
            targets += check_decode(args.decode)
        if args.decode_panels:
            targets += check_decode(args.decode_panels, "--decode-panels")
    except CheckError as error:
        print(f"relpos: error: {error}", file=sys.stderr)
        return 2
    csvs = [c for c in (args.training, args.bf16, *args.attention, args.decode,
                        args.decode_panels) if c]
    command = " ".join(["python benchmarks/last_mile.py",
                        *(argv if argv is not None else sys.argv[1:])])
    head = [f"# Native kernels: targets ({report_date()})", "",
            f"- **command**: `{command}`",
            *(f"- **{name}**: {line}" for name, line in machines(csvs)), ""]
    if args.run is not None:
        settings = [f"{k}={os.environ[k]}" for k in SETTINGS if os.environ.get(k)]
        head.insert(3, f"- **settings**: {' '.join(settings) if settings else 'none set'} "
                       f"(of {', '.join(SETTINGS)})")
    if args.quick:
        head[1:1] = ["", "A --quick run (tiny shapes, one round, no warm-up): the verdicts "
                     "below try the pipeline and mean nothing."]
    text = "\n".join([*head, report(targets), ""])
    print(text)
    if args.out:
        write_files({args.out: text})
    return 1 if any(t.met is False and not t.alternative for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
