"""``relpos kernels``: the native CPU kernels — whether they are built on this machine (and
sound: a cached library whose checksum does not match is reported as damaged), where, for
which instruction set — and ``--build`` to compile them now rather than on first use."""

from __future__ import annotations

import argparse

from relpos.cli import CLIError

SUMMARY = "show (or build) the native CPU kernels"
DESCRIPTION = """\
Print whether relpos's native CPU kernels are built for this machine, where they are cached,
for which instruction set and torch version, and how their GEMMs run. They compile on first
use (once per machine, cached); --build compiles them now. A cached library that does not
match the checksum recorded when it was built is reported as damaged, never loaded, and
rebuilt (where the cache is writable). RELPOS_NATIVE=0 turns them off;
RELPOS_CACHE_DIR moves the cache.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos kernels``."""
    p.add_argument("--build", action="store_true",
                   help="compile the kernels now if this machine has none (about a minute)")


def run(args: argparse.Namespace) -> int:
    from relpos.ops.native import build

    if args.build:
        if build.disabled():
            raise CLIError("the native kernels are turned off (RELPOS_NATIVE=0); unset it to "
                           "build them")
        if build.load() is None:
            log = build.failure_log()
            raise CLIError(f"the native kernels could not be built: {build.failure()}"
                           + (f" (the full output: {log})" if log else ""))
    s = build.status()
    if not s.enabled:
        state = "off (RELPOS_NATIVE=0)"
    elif s.built:
        state = "built"
    elif s.damaged:
        state = (f"damaged: {s.damaged}; not loaded (rebuilt on first use where the cache is "
                 "writable, or now with --build)")
    else:
        state = "not built yet (they compile on first use, or now with --build)"
    print(f"native kernels: {state}")
    print(f"cache:          {s.directory}")
    print(f"ISA:            {s.isa}")
    print(f"torch:          {s.torch_version}")
    print(f"GEMMs:          {s.blas}")
    if s.failure:
        print(f"last failure:   {s.failure}")
    return 0
