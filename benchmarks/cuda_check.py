"""CUDA check of the fused backend: correctness against the reference, then timing.

Run on a machine with a CUDA device::

    python benchmarks/cuda_check.py            # checks + timings
    python benchmarks/cuda_check.py --quick    # checks only

Correctness: float32 forward and all five gradients against the reference backend computed
in float64 on the same device (shared and per-head tables, causal and not, L != S, K = 0,
K >= n - 1), plus a bitwise determinism check of the backward. Timing: forward and
forward + backward of ``fused`` and plain ``F.scaled_dot_product_attention`` (no relative
terms), median of CUDA-event-timed repeats, and peak CUDA memory. Exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

import relpos

CASES = [
    # (B, H, L, S, D, K, causal, per_head)
    (2, 4, 128, 128, 64, 16, False, False),
    (2, 4, 128, 128, 64, 16, True, True),
    (1, 2, 77, 93, 64, 5, False, False),
    (1, 2, 1, 300, 64, 8, True, False),
    (1, 2, 64, 64, 32, 0, False, True),
    (1, 2, 50, 50, 64, 60, False, False),
]


def _problem(B: int, H: int, L: int, S: int, D: int, K: int, per_head: bool,
             dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    lead = (H,) if per_head else ()
    shapes = [(B, H, L, D), (B, H, S, D), (B, H, S, D), (*lead, 2 * K + 1, D),
              (*lead, 2 * K + 1, D)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to("cuda", dtype).requires_grad_()
            for s in shapes]


def _run(leaves: list[torch.Tensor], K: int, causal: bool, impl: str,
         upstream: torch.Tensor) -> list[torch.Tensor]:
    q, k, v, ak, av = leaves
    out = relpos.relative_attention(q, k, v, max_distance=K, rel_keys=ak, rel_values=av,
                                    is_causal=causal, implementation=impl)  # type: ignore[arg-type]
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype))
    return [out.detach(), *grads]


def check() -> bool:
    ok = True
    names = ["out", "dq", "dk", "dv", "drel_keys", "drel_values"]
    for B, H, L, S, D, K, causal, per_head in CASES:
        leaves32 = _problem(B, H, L, S, D, K, per_head, torch.float32)
        leaves64 = [t.detach().double().requires_grad_() for t in leaves32]
        upstream = torch.randn(B, H, L, D, device="cuda", dtype=torch.float64)
        reason = relpos.ops.fused.unsupported_reason(  # type: ignore[attr-defined]
            leaves32[0], leaves32[1], leaves32[2], rel_keys=None, rel_values=None,
            max_distance=K, attn_mask=None, key_mask=None, is_causal=causal, dropout_p=0.0,
            scale=1.0, query_start=S - L)
        if reason is not None:
            print(f"SKIP {(B, H, L, S, D, K, causal, per_head)}: {reason}")
            continue
        truth = _run(leaves64, K, causal, "reference", upstream)
        fused = _run(leaves32, K, causal, "fused", upstream)
        again = _run(leaves32, K, causal, "fused", upstream)
        for name, a, t, b in zip(names, fused, truth, again, strict=True):
            err = (a.double() - t).abs().max().item()
            scale = t.abs().max().item() + 1e-6
            good = err <= 1e-4 * scale + 1e-5
            same = torch.equal(a, b)
            ok &= good and same
            print(f"{'ok  ' if good and same else 'FAIL'} B={B} H={H} L={L} S={S} K={K} "
                  f"causal={causal} per_head={per_head} {name}: max err {err:.2e} "
                  f"(scale {scale:.2e}), deterministic={same}")
    return ok


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
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


def bench(lengths: list[int], K: int, dtype: torch.dtype, repeats: int) -> None:
    B, H, D = 1, 8, 64
    print(f"\ntiming: B={B} H={H} D={D} K={K} {dtype}, median of {repeats} (ms), peak MiB")
    print(f"{'n':>6} {'sdpa fwd':>9} {'fused fwd':>10} {'ratio':>6} {'sdpa f+b':>9} "
          f"{'fused f+b':>10} {'ratio':>6} {'sdpa MiB':>9} {'fused MiB':>10}")
    for n in lengths:
        q, k, v, ak, av = _problem(B, H, n, n, D, K, False, dtype)
        go = torch.randn_like(q)

        def sdpa(q=q, k=k, v=v) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return F.scaled_dot_product_attention(q, k, v)

        def fused(q=q, k=k, v=v, ak=ak, av=av) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return relpos.relative_attention(q, k, v, max_distance=K, rel_keys=ak,
                                             rel_values=av, implementation="fused")

        res = {}
        for name, fn in (("sdpa", sdpa), ("fused", fused)):
            with torch.no_grad():
                res[name + "_f"] = _time(fn, repeats)
            res[name + "_fb"] = _time(lambda fn=fn, go=go: fn().backward(go), repeats)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn().backward(go)
            torch.cuda.synchronize()
            res[name + "_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"{n:>6} {res['sdpa_f']:>9.2f} {res['fused_f']:>10.2f} "
              f"{res['fused_f'] / res['sdpa_f']:>6.2f} {res['sdpa_fb']:>9.2f} "
              f"{res['fused_fb']:>10.2f} {res['fused_fb'] / res['sdpa_fb']:>6.2f} "
              f"{res['sdpa_mib']:>9.0f} {res['fused_mib']:>10.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="correctness checks only")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--max-distance", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    ok = check()
    if not args.quick:
        bench([int(x) for x in args.lengths.split(",")], args.max_distance,
              getattr(torch, args.dtype), args.repeats)
    print("\nALL CHECKS PASSED" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
