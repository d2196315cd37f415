"""``relpos bench``: time relpos backends against plain scaled dot-product attention.

Times the forward (under ``torch.no_grad``) and the forward + backward of every backend on
self-attention with both relative terms for each sequence length n and clip distance K,
and ``F.scaled_dot_product_attention`` without relative terms in the same interleaved
rounds (medians); measures the peak memory of one forward + backward per case in a fresh
subprocess; skips cases that would not fit in memory. ``--decode`` times one KV-cache
decode step of ``--steps`` new tokens over caches of ``--lengths`` keys instead.
``--preset training`` times every backend at training shapes (``--tokens`` per batch,
B x n = 64x64 ... 1x4096, K = 16 and 64, causal and not); ``--preset encoder`` times a
training step of a 6-layer encoder of relpos layers against the same one of torch's.
Every report records the CPU, its instruction sets, torch, the threads and
OMP_WAIT_POLICY; ``--omp-wait-policy`` reruns the benchmark with that set.

The harness is :mod:`relpos.bench` (:mod:`relpos.bench.attention`,
:mod:`relpos.bench.decode`, :mod:`relpos.bench.presets`, :mod:`relpos.bench.encoder`; the
report files of :func:`relpos.bench.common.report_files`, the rerun of
:func:`relpos.bench.hardware.rerun_with_policy`); this module only parses the options, checks
how they combine and dispatches. It imports no torch until the benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relpos._deprecated import module_getattr, moved
from relpos.bench import hardware
from relpos.bench.common import DTYPES, report_files, typed_command
from relpos.cli import CLIError, _args

#: What ``--preset`` takes.
PRESETS = ("training", "encoder")

SUMMARY = "time relpos backends against plain SDPA (ms, ratio, peak memory)"
DESCRIPTION = __doc__.split("\n\n")[1] if __doc__ else ""

# The parser of ``relpos bench``, kept to spell a parsed command line out again when the
# benchmark reruns in a subprocess (--omp-wait-policy).
_PARSER: list[argparse.ArgumentParser] = []


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos bench``."""
    _PARSER[:] = [p]
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="training: every backend at training shapes (--tokens per batch, "
                        "B x n = 64x64 ... 1x4096, K=16,64, causal and not; --causal: causal "
                        "only); encoder: a training step of a 6-layer encoder (E=512, H=8, "
                        "FF=2048, K=16) of relpos layers against torch's, B x n = 32x128, "
                        "8x512")
    p.add_argument("--tokens", type=_args.positive_int, default=None,
                   help="with --preset: tokens per batch B x n, B = tokens // n (default 4096)")
    p.add_argument("--lengths", type=_args.int_list(1), default=None,
                   help="sequence lengths n (with --decode: cache lengths S), comma-separated "
                        "(default: 512,...,16384; --preset training: 64,128,...,--tokens; "
                        "--preset encoder: 128,512)")
    p.add_argument("--max-distances", type=_args.int_list(0), default=None,
                   help="clip distances K, comma-separated (default: 16,64; with --decode 64)")
    p.add_argument("--batch", type=_args.positive_int, default=None,
                   help="batch size B (default 1)")
    p.add_argument("--heads", type=_args.positive_int, default=None, help="heads H (default 8)")
    p.add_argument("--head-dim", type=_args.positive_int, default=None,
                   help="head dim D (default 64)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default float32")
    p.add_argument("--repeats", type=_args.positive_int, default=None,
                   help="measured rounds, median reported (default 3; with --decode 15)")
    p.add_argument("--warmup", type=_args.non_negative_int, default=None,
                   help="warm-up rounds (default 1; with --decode 3)")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends: auto (what relpos picks; the table's note "
                        "names the backend), any of relpos.available_backends() and sdpa "
                        "(default: all but decode; with --decode: the backends timed by name "
                        "besides relpos (auto) and sdpa, default all but reference; with "
                        "--preset training: any of auto,flash_regions,bucketed,reference, "
                        "default all, SDPA always runs; with --preset encoder: the relpos layers' "
                        "implementations, default auto, torch's model always runs)")
    _args.add_threads(p, "torch threads (default: torch's default)")
    p.add_argument("--out", default=None,
                   help="directory for attention.md, attention.csv and attention.png (with "
                        "--decode: decode.md and decode.csv, or a .md path; with --preset P: "
                        "P.md and P.csv)")
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run (n=256,512, K=16, 1 warm-up, 2 repeats; with "
                        "--decode S=512,1024, 1 warm-up, 3 repeats)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the per-case peak-memory subprocesses")
    p.add_argument("--memory-budget", type=_args.positive_float, default=None, metavar="GIB",
                   help="skip cases whose estimated peak exceeds this many GiB "
                        "(default: 60%% of the available memory)")
    p.add_argument("--causal", action="store_true",
                   help="causal self-attention (is_causal=True) for every backend and SDPA")
    g = p.add_argument_group("decode")
    g.add_argument("--decode", action="store_true",
                   help="run the KV-cache decode benchmark instead")
    g.add_argument("--steps", type=_args.int_list(1), default=None, metavar="T,T,...",
                   help="new tokens per decode step, comma-separated (default: 1,64)")
    p.add_argument("--omp-wait-policy", choices=hardware.POLICIES, default=None,
                   help="run the benchmark in a subprocess with OMP_WAIT_POLICY set to this "
                        "(OpenMP reads it when torch loads, so it cannot change in this "
                        "process); passive keeps idle threads from spinning on a busy machine")


def output_files(args: argparse.Namespace) -> list[Path]:
    """The report files ``--out`` names (none without it), checked before any timing.

    Raises:
        CLIError: if ``--out`` is a file (or lies under one) where a directory is meant, or
            a report file would replace a directory.
    """
    if not args.out:
        return []
    out = Path(args.out)
    name = getattr(args, "preset", None) or ("decode" if args.decode else "attention")
    files = report_files(out, name, file_ok=args.decode)
    if out in files:  # --decode --out x.md: the report's files themselves
        _args.check_output_dir(out.parent, f"--out {str(out)!r}: its directory")
    else:
        _args.check_output_dir(out)
    for path in files:
        if path.is_dir():
            raise CLIError(f"--out {str(args.out)!r}: the report {str(path)!r} is a directory")
    return files


def _check_combination(args: argparse.Namespace) -> None:
    """Options that do not go together.

    Raises:
        CLIError: naming the option and what it applies to.
    """
    preset = getattr(args, "preset", None)
    if args.steps is not None and not args.decode:
        raise CLIError("--steps applies to relpos bench --decode only")
    if preset and args.decode:
        raise CLIError(f"--preset {preset} and --decode are different benchmarks; pick one")
    if getattr(args, "tokens", None) is not None and not preset:
        raise CLIError("--tokens applies to relpos bench --preset training/encoder only")
    if preset and args.batch is not None:
        raise CLIError(f"--batch does not apply to --preset {preset}: B = --tokens // n")
    if preset == "encoder":
        fixed = [o for o, v in (("--heads", args.heads), ("--head-dim", args.head_dim),
                                ("--causal", args.causal or None)) if v is not None]
        if fixed:
            raise CLIError(f"{fixed[0]} does not apply to --preset encoder: its model is fixed "
                           "(E=512, H=8, FF=2048, not causal)")


def _benchmark(args: argparse.Namespace) -> tuple[Callable[[Any], object], Callable[[Any], int]]:
    """``(check, run)`` of the benchmark the options ask for: ``check(args)`` resolves and
    checks the settings (raises ``ValueError``) without timing anything."""
    preset = getattr(args, "preset", None)
    if preset == "training":
        from relpos.bench import presets

        return presets.training_settings, presets.run_training
    if preset == "encoder":
        from relpos.bench import encoder

        return encoder.encoder_settings, encoder.run_encoder
    if args.decode:
        from relpos.bench import decode

        return decode.settings, decode.run_decode
    from relpos.bench import attention

    return attention.config, attention.run_attention


def command_argv(args: argparse.Namespace) -> list[str]:
    """The ``relpos bench`` arguments that parse to ``args`` (each option set to other than
    its default, spelled by its long name)."""
    argv = ["bench"]
    for action in _PARSER[0]._actions if _PARSER else ():
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # a flag: store_true / store_false
            argv.append(flag)
        else:
            text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
            argv += [flag, text]
    return argv


def run(args: argparse.Namespace) -> int:
    """``relpos bench``: check the options, warn when ``OMP_WAIT_POLICY`` is unset (or rerun
    with ``--omp-wait-policy``), then run the attention benchmark, the decode one
    (``--decode``) or a preset (``--preset``)."""
    # An old backend name typed on the command line: its DeprecationWarning is for the user.
    warnings.filterwarnings("default", "--backends ", DeprecationWarning)
    _check_combination(args)
    output_files(args)
    check, benchmark = _benchmark(args)
    check(args)
    policy = getattr(args, "omp_wait_policy", None)
    if policy is not None and hardware.omp_wait_policy().lower() != policy:
        return hardware.rerun_with_policy(command_argv(args), policy)
    warning = hardware.omp_warning(typed_command(args) or "relpos bench ...")
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    return benchmark(args)


# Names this module defined before the harness moved to relpos.bench.
__getattr__ = module_getattr(__name__, {
    **{name: moved(f"relpos.bench.attention.{name}") for name in (
        "DEFAULT_LENGTHS", "DEFAULT_MAX_DISTANCES", "QUICK_LENGTHS", "QUICK_MAX_DISTANCES",
        "MEMORY_METHOD", "Config", "Result", "estimate_bytes", "measure_memory", "run_attention",
    )},
    "BACKENDS": (
        "relpos.bench.attention.backends()",
        lambda: importlib.import_module("relpos.bench.attention").backends(),
    ),
})
