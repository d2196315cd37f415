"""The native kernels' GEMM engines against each other on the training shapes, in one
interleaved run: which hand-written engine still earns its place beside the libraries.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/gemm_engines.py --out benchmarks

For each training shape (B x n = 64 x 64, 16 x 256, 4 x 1024, 1 x 4096; H = 8, D = 64, both
tables shared by the heads, K = 16 and 64, causal and not) it times one native call, forward
(no grad) and forward + backward, once per engine, every engine of a dtype in the same rounds
(the order rotated each round; medians), with plain SDPA in the rounds as the yardstick:

- float32: ``vec`` (the kernels' own AVX-512/AVX2 GEMM), ``blas`` (MKL's ``sgemm_``), ``aten``
  (libtorch's matrix multiply), ``brgemm`` (libtorch's ``at::native::cpublas::brgemm``,
  oneDNN's micro-kernels);
- bfloat16: ``avx512bf16`` (the kernels' VDPBF16PS tiles), ``amx`` (the kernels' AMX tiles,
  where the CPU has AMX), ``mkl`` (MKL's ``cblas_gemm_bf16bf16f32``), ``widened`` (tiles widened
  to float32, the float engine's GEMMs), ``brgemm`` (cpublas::brgemm on VNNI-packed operands).

An engine is chosen per call by the switch the kernels read at each call's entry
(``RELPOS_NATIVE_FLOAT_GEMM``, ``RELPOS_NATIVE_BF16_GEMM``); --float-engines and --bf16-engines
name the ones to time (the defaults: every engine the kernels offer now; ``blas``, ``aten`` and
``mkl`` were timed on the build before their removal, the report says so). Writes
``gemm_engines_<cpu>.md`` into --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import relpos
from relpos.bench import common
from relpos.bench.hardware import omp_warning

SHAPES = ((64, 64), (16, 256), (4, 1024), (1, 4096))
H, D = 8, 64
FLOAT_ENGINES = ("vec", "brgemm")
BF16_ENGINES = ("avx512bf16", "amx", "widened", "brgemm")
SWITCH = {
    torch.float32: "RELPOS_NATIVE_FLOAT_GEMM",
    torch.bfloat16: "RELPOS_NATIVE_BF16_GEMM",
}


_ASKED: dict[torch.dtype, tuple[str, ...]] = {}


def _engines(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype in _ASKED:
        return _ASKED[dtype]
    if dtype == torch.float32:
        return FLOAT_ENGINES
    from relpos.ops.native.build import load

    module = load()
    have_amx = module is not None and "amx=bf16" in module.build_info()
    return tuple(e for e in BF16_ENGINES if e != "amx" or have_amx)


def _cases(dtype: torch.dtype, B: int, n: int, K: int, causal: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for _ in range(3))
    ak, av = (torch.randn(2 * K + 1, D, generator=g).to(dtype) * 0.1 for _ in range(2))
    grad = torch.randn(B, H, n, D, generator=g).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, ak, av)]

    def call(x: list[torch.Tensor]) -> torch.Tensor:
        return relpos.relative_attention(x[0], x[1], x[2], rel_keys=x[3], rel_values=x[4],
                                         max_distance=K, is_causal=causal,
                                         implementation="native")

    def with_engine(engine: str, fn):
        def run() -> object:
            os.environ[SWITCH[dtype]] = engine
            try:
                return fn()
            finally:
                del os.environ[SWITCH[dtype]]
        return run

    def fwd() -> object:
        with torch.no_grad():
            return call(leaves)

    def fwd_bwd() -> object:
        for t in leaves:
            t.grad = None
        call(leaves).backward(grad)
        return None

    def sdpa_fwd() -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    sq = [t.clone().requires_grad_() for t in (q, k, v)]

    def sdpa_fwd_bwd() -> object:
        for t in sq:
            t.grad = None
        F.scaled_dot_product_attention(*sq, is_causal=causal).backward(grad)
        return None

    cases = {("sdpa",): (sdpa_fwd, sdpa_fwd_bwd)}
    for e in _engines(dtype):
        cases[(e,)] = (with_engine(e, fwd), with_engine(e, fwd_bwd))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the report here")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--float-engines", default=None, help="comma-separated")
    parser.add_argument("--bf16-engines", default=None, help="comma-separated")
    args = parser.parse_args(argv)
    if args.float_engines:
        _ASKED[torch.float32] = tuple(args.float_engines.split(","))
    if args.bf16_engines:
        _ASKED[torch.bfloat16] = tuple(args.bf16_engines.split(","))
    threads = common.use_threads(args.threads)
    warn = omp_warning("benchmarks/gemm_engines.py")
    if warn:
        print(warn, file=sys.stderr)
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for B, n in SHAPES:
            for K in (16, 64):
                for causal in (False, True):
                    cases = _cases(dtype, B, n, K, causal)
                    med, fail = common.interleaved_medians(cases, warmup=2, repeats=args.repeats,
                                                           rotate=True)
                    if fail:
                        raise SystemExit(f"failed: {fail}")
                    base = med[("sdpa",)]
                    engines = [c[0] for c in cases if c[0] != "sdpa"]
                    for p, pas in enumerate(("fwd", "fwd+bwd")):
                        best = min(engines, key=lambda e: med[(e,)][p])
                        row = [name, f"{B}x{n}", K, "yes" if causal else "no", pas,
                               common.format_ms(base[p])]
                        row += [f"{med[(e,)][p] / base[p]:.2f}" for e in engines]
                        row += [best]
                        rows.append((engines, row))
                        print(" ".join(str(x) for x in row), flush=True)
    meta = {**common.environment(threads), "date": common.report_date(),
            "command": "OMP_WAIT_POLICY=PASSIVE python benchmarks/gemm_engines.py "
                       + " ".join(argv if argv is not None else sys.argv[1:])}
    cpu_name = meta.get("hardware", "")
    lines = [f"# The native kernels' GEMM engines on the training shapes ({cpu_name})",
             "", *common.markdown_meta(meta), ""]
    by_dtype: dict[str, list] = {}
    for engines, row in rows:
        by_dtype.setdefault(row[0], []).append((engines, row))
    csv_rows = []
    for name, items in by_dtype.items():
        engines = items[0][0]
        head = ["B x n", "K", "causal", "pass", "SDPA ms", *[f"{e} / SDPA" for e in engines],
                "fastest"]
        lines += [f"## {name}", "", *common.markdown_table(head, [[str(c) for c in r[1:]] for _, r in items]), ""]
        for e in engines:
            i = engines.index(e)
            ratios = [float(r[6 + i]) / min(float(x) for x in r[6:6 + len(engines)])
                      for _, r in items]
            lines.append(f"- `{e}`: geometric mean of its time over the fastest engine's "
                         f"{statistics.geometric_mean(ratios):.3f} (worst {max(ratios):.2f})")
        lines.append("")
        csv_rows += [r for _, r in items]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        cpu = "epyc" if "AMD" in meta.get("hardware", "") else "xeon"
        base = args.out / f"gemm_engines_{cpu}"
        common.write_files({base.with_suffix(".md"): text + "\n"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
