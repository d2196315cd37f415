"""relpos in bfloat16 / float16 against the same relpos call in float32, in one process.

The question a user with 16-bit training asks: is the 16-bit call faster than the float32
one on this CPU? Self-attention with shared Shaw tables (keys and values terms) at a fixed
number of tokens per batch (B = tokens // n), H=8, D=64, through
``relpos.relative_attention`` with the backend it picks (the native kernels where built);
each 16-bit case and its float32 twin take the same inputs (the 16-bit ones rounded), in
interleaved rounds, medians: the forward under ``torch.no_grad()``, then forward + backward
of a random upstream gradient. The ratio is 16-bit time over float32 time (< 1: the 16-bit
call is faster).

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.half_precision --out benchmarks

writes ``half_precision.md`` and ``half_precision.csv``. With ``--bf16-engines amx,avx512bf16,
brgemm,widened`` the bfloat16 call runs once per engine (``RELPOS_NATIVE_BF16_GEMM``: AMX
tiles, VDPBF16PS on the same packed tiles, libtorch's brgemm, tiles widened to float32; an
engine this machine lacks gives way to the next, each row names the one that ran, as the
loaded kernels say) against the same float32 call, into ``half_precision_engines.md`` /
``.csv``. ``MKL_ENABLE_INSTRUCTIONS`` (MKL's own switch, recorded in the header)
holds MKL to an older instruction set.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from relpos.bench import common

H, D = 8, 64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINE_ENV = "RELPOS_NATIVE_BF16_GEMM"
ENGINES = ("amx", "avx512bf16", "brgemm", "widened")


def _under(engine: str | None, fn: Callable[[], object]) -> Callable[[], object]:
    """fn, run with ``RELPOS_NATIVE_BF16_GEMM=engine`` (as it was when engine is None)."""
    if engine is None:
        return fn

    def run() -> object:
        old = os.environ.get(ENGINE_ENV)
        os.environ[ENGINE_ENV] = engine
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[ENGINE_ENV]
            else:
                os.environ[ENGINE_ENV] = old
    return run


def _engine_run(engine: str) -> str | None:
    """The engine a bfloat16 call asking for ``engine`` runs on here, as the loaded kernels
    say (their ``gemm_engines()``); None without the native kernels (no engine runs)."""
    from relpos.ops.native.build import gemm_engines, load

    module = load(quiet=True)
    if module is None:
        return None
    return str(_under(engine, lambda: gemm_engines(module)["bfloat16"])())


def _case(n: int, batch: int, k: int, causal: bool, dtype: torch.dtype, seed: int
          ) -> tuple[Callable[[], object], Callable[[], object], str]:
    """The forward and forward + backward of one call in ``dtype`` (inputs drawn in float32
    with ``seed`` and rounded), and the backend relpos picks for it."""
    from relpos.functional import relative_attention, select_backend

    g = torch.Generator().manual_seed(seed)
    q, key, v = (torch.randn(batch, H, n, D, generator=g).to(dtype) for _ in range(3))
    rk, rv = ((0.5 * torch.randn(2 * k + 1, D, generator=g)).to(dtype) for _ in range(2))
    up = torch.randn(batch, H, n, D, generator=g).to(dtype)
    leaves = [t.requires_grad_(True) for t in (q, key, v, rk, rv)]

    def fwd() -> object:
        with torch.no_grad():
            return relative_attention(q, key, v, max_distance=k, rel_keys=rk, rel_values=rv,
                                      is_causal=causal)

    def fwd_bwd() -> object:
        out = relative_attention(q, key, v, max_distance=k, rel_keys=rk, rel_values=rv,
                                 is_causal=causal)
        return torch.autograd.grad(out, leaves, up)

    backend = select_backend(q, key, v, max_distance=k, rel_keys=rk, rel_values=rv,
                             is_causal=causal)
    return fwd, fwd_bwd, backend


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="relpos in 16-bit against the same call in float32, in one process.")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per batch (B = tokens // n)")
    ap.add_argument("--lengths", default="64,128,256,512,1024,4096")
    ap.add_argument("--max-distances", default="16,64")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float16")
    ap.add_argument("--bf16-engines", default=None,
                    help="comma-separated bfloat16 engines timed side by side instead of "
                         f"--dtypes: {', '.join(ENGINES)}")
    ap.add_argument("--causal", action="store_true", help="causal calls (default: not)")
    common.add_timing_options(ap, repeats=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="directory for the report")
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.max_distances = [int(x) for x in args.max_distances.split(",")]
    except ValueError:
        ap.error("--lengths and --max-distances take comma-separated integers")
    if any(x < 1 for x in args.lengths) or any(x < 0 for x in args.max_distances):
        ap.error("--lengths must be >= 1 and --max-distances >= 0")
    if any(x > args.tokens for x in args.lengths):
        ap.error(f"--lengths must be at most --tokens ({args.tokens})")
    args.dtypes = args.dtypes.split(",")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        ap.error(f"--dtypes: unknown {unknown}; allowed: {sorted(DTYPES)}")
    if args.bf16_engines is not None:
        args.bf16_engines = args.bf16_engines.split(",")
        unknown = [e for e in args.bf16_engines if e not in ENGINES]
        if unknown:
            ap.error(f"--bf16-engines: unknown {unknown}; allowed: {list(ENGINES)}")
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    threads = common.use_threads(args.threads)
    clock = common.RunClock()
    # what is timed beside float32: (label, dtype, engine asked for or None)
    variants: list[tuple[str, torch.dtype, str | None]] = []
    if args.bf16_engines is not None:
        for engine in args.bf16_engines:
            ran = _engine_run(engine)
            label = "bfloat16 (no native kernels)" if ran is None else f"bfloat16 {ran}"
            if all(label != v[0] for v in variants):
                variants.append((label, torch.bfloat16, engine))
    else:
        variants = [(name, DTYPES[name], None) for name in args.dtypes]
    labels = [v[0] for v in variants]
    rows = []
    for n in args.lengths:
        batch = max(1, args.tokens // n)
        for k in args.max_distances:
            cases: dict[str, list[Callable[[], object]]] = {}
            picks: dict[str, str] = {}
            for name, dtype, engine in [("float32", torch.float32, None), *variants]:
                fwd, fwd_bwd, picks[name] = _case(n, batch, k, args.causal, dtype, seed=n + k)
                cases[name] = [_under(engine, fwd), _under(engine, fwd_bwd)]
            med, _ = common.interleaved_medians(
                cases, warmup=args.warmup, repeats=args.repeats, rotate=True)
            base = med["float32"]
            for name in labels:
                rows.append((f"{batch} x {n}", k, name, picks[name],
                             base[0], med[name][0], med[name][0] / base[0],
                             base[1], med[name][1], med[name][1] / base[1]))
            print(f"{batch} x {n} K={k}: " + ", ".join(
                f"{name} fwd {med[name][0] / base[0]:.2f}x f+b {med[name][1] / base[1]:.2f}x"
                for name in labels), file=sys.stderr, flush=True)
    head = ["B x n", "K", "dtype", "backend", "fp32 fwd ms", "fwd ms", "fwd / fp32",
            "fp32 f+b ms", "f+b ms", "f+b / fp32"]
    body = common.markdown_table(head, [
        (shape, str(k), name, backend, common.format_ms(f32), common.format_ms(f16),
         f"**{r:.2f}**", common.format_ms(b32), common.format_ms(b16), f"**{rb:.2f}**")
        for shape, k, name, backend, f32, f16, r, b32, b16, rb in rows])
    meta = {
        "date": common.report_date(),
        "command": common.script_command("relpos.bench.half_precision") + " " + " ".join(
            sys.argv[1:] if argv is None else argv),
        **common.environment(threads),
        "shapes": f"{args.tokens} tokens per batch, H={H}, D={D}, "
                  f"{'causal' if args.causal else 'not causal'}, shared tables (2K+1 rows)",
        "timing": f"{args.warmup} warm-up round(s), then the median of {args.repeats} "
                  "interleaved rounds (every dtype of a shape in turn, rotating)",
        **clock.meta(),
    }
    for name in ("MKL_ENABLE_INSTRUCTIONS", ENGINE_ENV):
        if os.environ.get(name):
            meta[name] = os.environ[name]
    stem = "half_precision" if args.bf16_engines is None else "half_precision_engines"
    common.print_report("relpos in 16-bit against float32", __doc__, meta, body, args.out,
                        f"{stem}.md")
    if args.out:
        common.write_files({args.out / f"{stem}.csv": common.csv_text(
            ["B", "n", "K", "dtype", "backend", "fp32_fwd_ms", "fwd_ms", "fwd_over_fp32",
             "fp32_fwd_bwd_ms", "fwd_bwd_ms", "fwd_bwd_over_fp32"],
            [(s.split(" x ")[0], s.split(" x ")[1], k, name, b, f"{a:.3f}", f"{c:.3f}",
              f"{r:.4f}", f"{x:.3f}", f"{y:.3f}", f"{rb:.4f}")
             for s, k, name, b, a, c, r, x, y, rb in rows])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
