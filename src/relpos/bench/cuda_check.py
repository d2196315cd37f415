"""CUDA check of the flash_regions and triton backends: correctness against the reference,
then timing.

Run on a machine with a CUDA device::

    python -m relpos.bench.cuda_check             # checks + flash_regions timings
    python -m relpos.bench.cuda_check --quick     # checks only
    python -m relpos.bench.cuda_check --triton    # checks + the triton benchmark and report

Correctness: float32 forward and all five gradients of each backend (``--backends``) against
the reference backend computed in float64 on the same device (shared and per-head tables,
causal and not, L != S, K = 0, K >= n - 1, one decode step), plus a bitwise determinism check of
the backward. Exits 1 on a failed check.

flash_regions timing: forward and forward + backward of ``flash_regions`` and plain
``F.scaled_dot_product_attention`` (no relative terms), median of CUDA-event-timed repeats, and
peak CUDA memory.

Triton benchmark (``--triton``): bfloat16 training shapes, batches of ``--tokens`` tokens
(16k) at n = 128 ... 8192 (B = tokens / n) and one sequence of n = 32k; relpos's triton backend
(keys and values tables, K = ``--max-distance``) against FlashAttention-2 (``flash-attn``, if
installed) and SDPA, both without relative terms; forward and forward + backward, peak memory,
and the bfloat16 error of triton's output and gradients against the float64 reference on one
sequence of each length up to ``--exact-max``. The report (markdown: GPU, versions, date,
command) goes to ``--report``. The targets: forward + backward at most 1.3x FlashAttention-2
at n >= 1024, 1.5x at n = 128-512.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from relpos import _sysinfo as sysinfo
from relpos.bench import common
from relpos.functional import available_backends, relative_attention, select_backend

CASES = [
    # (B, H, L, S, D, K, causal, per_head)
    (2, 4, 128, 128, 64, 16, False, False),
    (2, 4, 128, 128, 64, 16, True, True),
    (1, 2, 77, 93, 64, 5, False, False),
    (1, 2, 1, 300, 64, 8, True, False),
    (1, 2, 64, 64, 32, 0, False, True),
    (1, 2, 50, 50, 64, 60, False, False),
    (1, 2, 200, 200, 128, 32, True, False),
]

TRAINING_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
LONG_LENGTH = 32768


def _problem(B: int, H: int, L: int, S: int, D: int, K: int, per_head: bool,
             dtype: torch.dtype, device: str = "cuda") -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    lead = (H,) if per_head else ()
    shapes = [(B, H, L, D), (B, H, S, D), (B, H, S, D), (*lead, 2 * K + 1, D),
              (*lead, 2 * K + 1, D)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
            for s in shapes]


def _run(leaves: list[torch.Tensor], K: int, causal: bool, impl: str,
         upstream: torch.Tensor) -> list[torch.Tensor]:
    q, k, v, ak, av = leaves
    out = relative_attention(q, k, v, max_distance=K, rel_keys=ak, rel_values=av,
                                    is_causal=causal, implementation=impl)  # type: ignore[arg-type]
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype))
    return [out.detach(), *grads]


def check(backends: Sequence[str]) -> bool:
    ok = True
    names = ["out", "dq", "dk", "dv", "drel_keys", "drel_values"]
    for impl in backends:
        for B, H, L, S, D, K, causal, per_head in CASES:
            leaves32 = _problem(B, H, L, S, D, K, per_head, torch.float32)
            leaves64 = [t.detach().double().requires_grad_() for t in leaves32]
            upstream = torch.randn(B, H, L, D, device="cuda", dtype=torch.float64)
            q, k, v, ak, av = leaves32
            try:
                select_backend(q, k, v, max_distance=K, rel_keys=ak, rel_values=av,
                               is_causal=causal, implementation=impl)  # type: ignore[arg-type]
            except RuntimeError as e:
                print(f"SKIP {impl} {(B, H, L, S, D, K, causal, per_head)}: {e}")
                continue
            truth = _run(leaves64, K, causal, "reference", upstream)
            got = _run(leaves32, K, causal, impl, upstream)
            again = _run(leaves32, K, causal, impl, upstream)
            for name, a, t, b in zip(names, got, truth, again, strict=True):
                err = (a.double() - t).abs().max().item()
                scale = t.abs().max().item() + 1e-6
                good = err <= 1e-4 * scale + 1e-5
                same = torch.equal(a, b)
                ok &= good and same
                print(f"{'ok  ' if good and same else 'FAIL'} {impl} B={B} H={H} L={L} S={S} "
                      f"D={D} K={K} causal={causal} per_head={per_head} {name}: max err "
                      f"{err:.2e} (scale {scale:.2e}), deterministic={same}")
    return ok


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _backward(fn: Callable[[], torch.Tensor], grad: torch.Tensor) -> None:
    """The forward ``fn`` and the backward of ``grad`` through it."""
    fn().backward(grad)


def _peak_mib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(lengths: list[int], K: int, dtype: torch.dtype, repeats: int) -> None:
    B, H, D = 1, 8, 64
    print(f"\ntiming: B={B} H={H} D={D} K={K} {dtype}, median of {repeats} (ms), peak MiB")
    print(f"{'n':>6} {'sdpa fwd':>9} {'regions fwd':>12} {'ratio':>6} {'sdpa f+b':>9} "
          f"{'regions f+b':>12} {'ratio':>6} {'sdpa MiB':>9} {'regions MiB':>12}")
    for n in lengths:
        q, k, v, ak, av = _problem(B, H, n, n, D, K, False, dtype)
        go = torch.randn_like(q)

        def sdpa(q=q, k=k, v=v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v)

        def regions(q=q, k=k, v=v, ak=ak, av=av) -> torch.Tensor:
            return relative_attention(q, k, v, max_distance=K, rel_keys=ak, rel_values=av,
                                      implementation="flash_regions")

        res = {}
        for name, fn in (("sdpa", sdpa), ("regions", regions)):
            with torch.no_grad():
                res[name + "_f"] = _time(fn, repeats)
            res[name + "_fb"] = _time(functools.partial(_backward, fn, go), repeats)
            res[name + "_mib"] = _peak_mib(functools.partial(_backward, fn, go))
        print(f"{n:>6} {res['sdpa_f']:>9.2f} {res['regions_f']:>12.2f} "
              f"{res['regions_f'] / res['sdpa_f']:>6.2f} {res['sdpa_fb']:>9.2f} "
              f"{res['regions_fb']:>12.2f} {res['regions_fb'] / res['sdpa_fb']:>6.2f} "
              f"{res['sdpa_mib']:>9.0f} {res['regions_mib']:>12.0f}")


# ----------------------------------------------------------------------------------------------
# The triton benchmark


def training_shapes(tokens: int, lengths: Sequence[int], long: int | None) -> list[tuple[int, int]]:
    """``(B, n)`` pairs: ``tokens / n`` sequences of each length, then one of ``long``."""
    shapes = []
    for n in lengths:
        if n <= 0 or tokens % n:
            raise ValueError(f"length {n} does not divide the {tokens} tokens of a batch")
        shapes.append((tokens // n, n))
    if long:
        shapes.append((1, long))
    return shapes


def flash_attn_func() -> Callable[..., torch.Tensor] | None:
    """FlashAttention-2's ``flash_attn_func`` ((B, L, H, D) layout), or None if not installed."""
    try:
        from flash_attn import flash_attn_func as fn
    except ImportError:
        return None
    return fn


def _exactness(n: int, H: int, D: int, K: int, causal: bool) -> dict[str, float]:
    """Max abs error of triton in bfloat16 and of the reference backend in bfloat16 against the
    float64 reference, for one sequence: the output and the five gradients."""
    names = ["out", "dq", "dk", "dv", "drel_keys", "drel_values"]
    leaves64 = _problem(1, H, n, n, D, K, False, torch.float64)
    upstream = torch.randn(1, H, n, D, device="cuda", dtype=torch.float64)
    truth = _run(leaves64, K, causal, "reference", upstream)
    errors = {}
    for impl in ("triton", "reference"):
        leaves = [t.detach().bfloat16().requires_grad_() for t in leaves64]
        got = _run(leaves, K, causal, impl, upstream)
        for name, a, t in zip(names, got, truth, strict=True):
            errors[f"{impl} {name}"] = (a.double() - t).abs().max().item()
    return errors


def triton_bench(args: argparse.Namespace) -> list[dict[str, object]]:
    """One row per (B, n): ms forward and forward + backward, peak MiB, ratios, errors."""
    H, D, K, causal = args.heads, args.head_dim, args.max_distance, args.causal
    fa2 = flash_attn_func()
    rows: list[dict[str, object]] = []
    for B, n in training_shapes(args.tokens, args.lengths, args.long):
        q, k, v, ak, av = _problem(B, H, n, n, D, K, False, torch.bfloat16)
        go = torch.randn_like(q)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "triton": functools.partial(
                relative_attention, q, k, v, max_distance=K, rel_keys=ak, rel_values=av,
                is_causal=causal, implementation="triton"),
            "sdpa": functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal),
        }
        if fa2 is not None:
            qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_()
                          for t in (q, k, v))
            fns["fa2"] = functools.partial(fa2, qt, kt, vt, causal=causal)
        row: dict[str, object] = {"B": B, "n": n}
        for name, fn in fns.items():
            grad = go if name != "fa2" else go.transpose(1, 2).contiguous()
            with torch.no_grad():
                row[f"{name} fwd"] = _time(fn, args.repeats)
            row[f"{name} f+b"] = _time(functools.partial(_backward, fn, grad), args.repeats)
            row[f"{name} MiB"] = _peak_mib(functools.partial(_backward, fn, grad))
        base = "fa2" if fa2 is not None else "sdpa"
        row["base"] = base
        row["fwd ratio"] = row["triton fwd"] / row[f"{base} fwd"]  # type: ignore[operator]
        row["f+b ratio"] = row["triton f+b"] / row[f"{base} f+b"]  # type: ignore[operator]
        if n <= args.exact_max:
            row.update(_exactness(n, H, D, K, causal))
        rows.append(row)
        print(row, flush=True)
    return rows


def format_report(rows: Sequence[dict[str, object]], meta: dict[str, str]) -> str:
    """The markdown report: a header of ``meta`` and one table line per row."""
    lines = ["# The triton backend on a GPU: speed and exactness", ""]
    lines += [f"- **{k}**: `{v}`" if k == "command" else f"- **{k}**: {v}"
              for k, v in meta.items()]
    lines += ["", "Times in ms (median of CUDA-event-timed repeats); ratios are triton / the "
              "baseline named (FlashAttention-2 if installed, else SDPA), both without relative "
              "terms. Errors: max abs against the float64 reference, triton bf16 (reference "
              "backend bf16).", ""]
    head = ["B x n", "triton fwd", "base fwd", "ratio", "triton f+b", "base f+b", "ratio",
            "triton MiB", "base MiB", "err out", "err dq", "err drel_values"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def err(row: dict[str, object], name: str) -> str:
        if f"triton {name}" not in row:
            return "-"
        return f"{row[f'triton {name}']:.2e} ({row[f'reference {name}']:.2e})"

    for r in rows:
        base = r["base"]
        cells = [f"{r['B']} x {r['n']}", f"{r['triton fwd']:.3f}", f"{r[f'{base} fwd']:.3f}",
                 f"{r['fwd ratio']:.2f}", f"{r['triton f+b']:.3f}", f"{r[f'{base} f+b']:.3f}",
                 f"{r['f+b ratio']:.2f}", f"{r['triton MiB']:.0f}", f"{r[f'{base} MiB']:.0f}",
                 err(r, "out"), err(r, "dq"), err(r, "drel_values")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="correctness checks only")
    parser.add_argument("--backends", default="flash_regions,triton",
                        help="comma-separated backends to check against the reference")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated lengths (flash_regions timing: 1024..16384; triton: "
                             "128..8192)")
    parser.add_argument("--max-distance", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the flash_regions timing (the triton benchmark is bfloat16)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--triton", action="store_true",
                        help="run the triton benchmark (bfloat16 training shapes) and write "
                             "the report")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per training batch")
    parser.add_argument("--long", type=int, default=LONG_LENGTH,
                        help="one sequence of this length after the training shapes (0: none)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--exact-max", type=int, default=2048,
                        help="longest n whose bf16 error against the float64 reference is "
                             "measured (the reference materializes n x n x D)")
    parser.add_argument("--report", type=Path, default=Path("benchmarks/triton_cuda.md"))
    args = parser.parse_args(argv)
    try:
        args.backends = list(common.check_backends(args.backends, available_backends()))
    except ValueError as e:
        parser.error(str(e))
    default = TRAINING_LENGTHS if args.triton else (1024, 2048, 4096, 8192, 16384)
    args.lengths = (list(default) if args.lengths is None
                    else [int(x) for x in args.lengths.split(",")])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    ok = check(args.backends)
    if not args.quick and args.triton:
        from relpos._io import atomic_write_text
        from relpos.bench.common import report_date, script_command

        rows = triton_bench(args)
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = "not installed"
        fa2 = flash_attn_func()
        env = sysinfo.environment()
        meta = {
            "GPU": torch.cuda.get_device_name(),
            "torch": env["torch"], "triton": triton_version,
            "flash-attn": "not installed" if fa2 is None else
            str(getattr(sys.modules.get("flash_attn"), "__version__", "installed")),
            "relpos": env["relpos"], "python": env["python"],
            "date": report_date(),
            "shape": f"H={args.heads} D={args.head_dim} K={args.max_distance} bfloat16 "
                     f"causal={args.causal}, batches of {args.tokens} tokens",
            "command": f"{script_command('relpos.bench.cuda_check')} "
                       + " ".join(sys.argv[1:]),
        }
        atomic_write_text(args.report, format_report(rows, meta))
        print(f"wrote {args.report}")
    elif not args.quick:
        bench(args.lengths, args.max_distance, getattr(torch, args.dtype), args.repeats)
    print("\nALL CHECKS PASSED" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
