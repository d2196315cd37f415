"""``relpos kernels``: the native CPU kernels — whether they are built on this machine (and
sound: a cached library whose checksum does not match is reported as damaged), where, for
which instruction set — ``--build`` to compile them now rather than on first use, and
``--build --into DIR`` to make a directory of prebuilt kernels for ``RELPOS_KERNELS_DIR``,
``--prune`` to remove the builds of other relpos or torch versions."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from relpos.cli import CLIError
from relpos.cli._args import name_list, non_negative_float

if TYPE_CHECKING:
    from relpos.ops.native.build import Pruned

SUMMARY = "show (or build) the native CPU kernels"
DESCRIPTION = """\
Print whether relpos's native CPU kernels are built for this machine, where they are cached,
for which instruction set and torch version, and what their GEMMs run on now (as the loaded
kernels say; RELPOS_NATIVE_FLOAT_GEMM and RELPOS_NATIVE_BF16_GEMM choose, docs/numerics.md).
They compile on first use (once per machine, cached); --build compiles them now. A cached
library that does not match the checksum recorded when it was built is reported as damaged,
never loaded, and rebuilt (where the cache is writable). RELPOS_NATIVE=0 turns them off;
RELPOS_CACHE_DIR moves the cache.

For machines that cannot compile (a container image without a compiler, a read-only
software tree), --build --into DIR compiles portable variants (amx, avx512bf16, avx512, avx2,
baseline on x86-64) into DIR; with RELPOS_KERNELS_DIR=DIR every process loads the best variant
its CPU runs from there (checksum first) and never writes there.

Each relpos or torch upgrade compiles a new build beside the old ones (3-8 MB each); --prune
removes every cached build this installation does not use (with --build --into DIR: the
builds in DIR of other relpos or torch versions). Another environment sharing the cache
rebuilds its own on first use; a build a process is compiling or loading stays. In a cache
that machines with different CPUs share (a home directory on NFS), --prune 7 keeps every
build some process loaded in the last 7 days. Loads never write to DIR: there a variant's last
load is its library's access time (to within a day) or this user's own record of it, and
--prune DAYS is refused where DIR's file system records no access times (noatime).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos kernels``."""
    from relpos._timings import FIRST_COMPILE_SECONDS, VARIANT_SECONDS, duration_text, range_text

    p.add_argument("--build", action="store_true",
                   help="compile the kernels now if this machine has none "
                        f"({duration_text(FIRST_COMPILE_SECONDS)} on 2 cores)")
    p.add_argument("--into", metavar="DIR",
                   help="with --build: compile portable variants into DIR, a directory of "
                        f"prebuilt kernels for RELPOS_KERNELS_DIR ({range_text(*VARIANT_SECONDS)}"
                        " each on 2 cores)")
    p.add_argument("--variants", metavar="NAMES",
                   type=name_list(VARIANTS, "variant(s)", distinct=True),
                   help="with --into: the variants to build, comma-separated (default: all "
                        "of this architecture's: amx,avx512bf16,avx512,avx2,baseline on x86-64, "
                        "baseline elsewhere)")
    p.add_argument("--prune", metavar="DAYS", nargs="?", const=0.0, default=None,
                   type=non_negative_float,
                   help="remove the cached builds of other relpos or torch versions or CPUs "
                        "(with --build --into DIR: those in DIR); with DAYS, only those no "
                        "process loaded in the last DAYS days (a cache machines share)")


#: Every variant name of every architecture (relpos.ops.native.variants: which exist here).
VARIANTS = ("amx", "avx512bf16", "avx512", "avx2", "baseline")


def run(args: argparse.Namespace) -> int:
    from relpos.ops.native import build

    if (args.into or args.variants) and not args.build:
        raise CLIError("--into and --variants go with --build (relpos kernels --build --into "
                       "DIR)")
    if args.variants and not args.into:
        raise CLIError("--variants goes with --into DIR (the user cache holds one build, for "
                       "this CPU)")
    if args.into:
        if args.prune:  # (before building: a refusal after a long build helps nobody)
            from relpos.ops.native.pruning import last_use_unknown

            unknown = last_use_unknown(Path(args.into))
            if unknown is not None:
                raise CLIError(f"--prune {args.prune:g}: {unknown}; use --prune without DAYS "
                               "once no environment reads the other versions' variants")
        return _build_into(Path(args.into), list(args.variants) if args.variants else None,
                           prune=args.prune)
    try:
        build.disabled()  # reads the switches first: a GEMM engine no kernel has is refused
    except ValueError as error:
        raise CLIError(str(error).removeprefix("relpos: ")) from None
    if args.build:
        if build.disabled():
            raise CLIError("the native kernels are turned off (RELPOS_NATIVE=0); unset it to "
                           "build them")
        if build.load() is None:
            log = build.failure_log()
            raise CLIError(f"the native kernels could not be built: {build.failure()}"
                           + (f" (the full output: {log})" if log else ""))
    if args.prune is not None:
        _say_pruned(build.prune(unused_days=args.prune), "the cache")
    s = build.status()
    gemms = s.gemms
    if gemms is None and s.enabled and (s.built or s.serving is not None):
        module = build.load(quiet=True)  # built: the kernels say what they run on
        gemms = None if module is None else build.gemm_engines(module)
    serving = s.serving if s.prebuilt_root is not None else None
    cache = "built" if s.built else (
        f"damaged: {s.damaged}; not loaded (rebuilt on first use where the cache is writable, "
        "or now with --build)" if s.damaged else
        "not built yet (they compile on first use, or now with --build)")
    if not s.enabled:
        state = "off (RELPOS_NATIVE=0): the PyTorch backends serve"
    elif serving is not None:
        state = (f"the prebuilt {serving.variant} variant serves (from RELPOS_KERNELS_DIR "
                 f"{s.prebuilt_root})")
    elif s.built:
        state = "built: the user cache's build serves"
    else:
        state = cache
    print(f"native kernels: {state}")
    print(f"cache:          {s.directory}" + ("" if serving is None or not s.enabled
                                               else f" ({cache})"))
    print(f"ISA:            {s.isa}")
    if s.vectors.startswith("none"):
        from relpos.ops.native import SCALAR_MAX_KEYS

        print(f"vector code:    {s.vectors}: auto-selection takes the kernels for calls of at "
              f"most {SCALAR_MAX_KEYS} keys, the PyTorch backends beyond")
    else:
        print(f"vector code:    {s.vectors}")
    print(f"torch:          {s.torch_version}")
    from relpos.ops.native.engines import gemm_lines

    if s.enabled:
        wide, half = gemm_lines(gemms)
        print(f"GEMMs:          {wide}")
        print(f"16-bit GEMMs:   {half}")
    if s.prebuilt_root is not None:
        serving = s.serving
        print(f"prebuilt:       {s.prebuilt_root} (RELPOS_KERNELS_DIR; "
              + (f"the {serving.variant} build serves)" if serving else
                 "nothing here serves this machine: the cache does)"))
        for p in s.prebuilt:
            print(f"  {p.variant + ':':15s} {p.state}")
    if s.others:
        latest = min(s.others, key=lambda o: o.unused_days)
        print(f"other builds:   {len(s.others)} in the cache, "
              f"{build.megabytes(sum(o.size for o in s.others))}, the latest loaded "
              f"{latest.last_used} (other relpos or torch versions or CPUs; relpos kernels "
              "--prune removes them)")
    if s.failure:
        print(f"last failure:   {s.failure}")
    return 0


def _say_pruned(found: list[Pruned], where: str) -> None:
    """What :func:`relpos.ops.native.build.prune` did, before the listing."""
    from relpos.ops.native import build

    removed = [p for p in found if p.kept is None]
    print(f"pruned:         {len(removed)} build{'' if len(removed) == 1 else 's'} of other "
          f"relpos or torch versions or CPUs from {where}, "
          f"{build.megabytes(sum(p.size for p in removed))}")
    for p in found:
        if p.kept is not None:
            print(f"  kept {p.name}: {p.kept}")


def _build_into(root: Path, names: list[str] | None, *, prune: float | None = None) -> int:
    from relpos.ops.native import build

    if root.exists() and not root.is_dir():
        raise CLIError(f"--into {root}: that is a file, not a directory")
    from relpos.ops.native.variants import variant

    for name in names or ():
        try:
            variant(name)
        except ValueError as error:
            raise CLIError(f"--variants: {error}") from None
    try:
        found = build.build_into(root, names)
    except build.BuildError as error:
        raise CLIError(f"the native kernels could not be built: {error.cause}"
                       + (f" (the full output: {error.log})" if error.log else "")) from None
    except OSError as error:
        raise CLIError(f"--into {root}: {error.strerror or error}") from None
    if prune is not None:
        try:
            pruned = build.prune(root, unused_days=prune)
        except ValueError as error:
            raise CLIError(f"--prune {prune:g}: {error}") from None
        _say_pruned(pruned, str(root))
    print(f"prebuilt kernels: {root}")
    for p in found:
        print(f"  {p.variant + ':':15s} {p.state}")
    print(f"use them with: RELPOS_KERNELS_DIR={root}")
    return 0
