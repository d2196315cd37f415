"""The native kernels' portable variants (``relpos kernels --build --into``) against the build
for exactly this CPU (``-march=native``, the per-user cache), at training shapes.

Each variant of a kernels directory, and the user cache's build, is loaded in a process of its
own (``RELPOS_KERNELS_DIR`` pointed at a directory holding that variant alone); each process
times native forward + backward (float32, or ``--dtype bfloat16``; H=8, D=64, K=16, shared
tables) at every shape and reports the median of its repeats. The processes run in interleaved
rounds; a variant's time is the median over rounds, its ratio is to the native build's in the
same run. A variant runs
only where the CPU runs it (``avx512`` needs AVX-512 F/BW/CD/DQ/VL, ``amx`` also AMX-TILE,
AMX-BF16 and AVX512-BF16).

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.kernel_variants --dir DIR --out benchmarks

``--dir`` defaults to ``build/kernel-variants``, where the variants are built first if absent
(35-45 s each on 2 cores: ``relpos._timings.VARIANT_SECONDS``); writes
``kernel_variants.md`` (``kernel_variants_bf16.md`` for bfloat16). ``--variants NAMES`` times
only those variants of the directory.

The header records what each build ran each dtype's GEMMs on, as its kernels say (their
``gemm_engines()``): a variant without vector code (``baseline``) runs float32's on libtorch's
brgemm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relpos.bench import common

SHAPES = ((32, 64, False), (4, 512, False), (4, 512, True), (1, 2048, True))

# One process: every shape, its median of ``repeats`` forward + backward steps, as JSON.
_CHILD = """
import json, sys, time, torch, relpos
from relpos.ops.native import build
torch.set_num_threads(int(sys.argv[1]))
repeats, shapes, out = int(sys.argv[2]), json.loads(sys.argv[3]), {}
dtype = getattr(torch, sys.argv[4])
module = build.load()
assert module is not None, build.failure()
for B, n, causal in shapes:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 8, n, 64, generator=g).to(dtype).requires_grad_(True)
               for _ in range(3))
    t = torch.randn(33, 64, generator=g).to(dtype).requires_grad_(True)
    def step():
        o = relpos.relative_attention(q, k, v, max_distance=16, rel_keys=t, rel_values=t,
                                      is_causal=causal, implementation="native")
        o.sum().backward()
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
    out[f"{B}x{n}{'c' if causal else ''}"] = sorted(times)[len(times) // 2] * 1e3
print(json.dumps({"library": module.__file__, "ms": out, "gemms": build.gemm_engines(module)}))
"""


def _key(shape: Sequence[object]) -> str:
    B, n, causal = shape
    return f"{B}x{n}{'c' if causal else ''}"


def _one(env: dict[str, str], threads: int, repeats: int, dtype: str) -> dict[str, Any]:
    """One timing process: ``{"library": ..., "ms": {shape: median ms}, "gemms": {dtype:
    engine}}`` (the GEMM engines as the kernels it loaded say)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(threads), str(repeats), json.dumps(SHAPES), dtype],
        env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"relpos: error: a timing process failed: {done.stderr.strip()[-500:]}")
    said: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return said


def run(root: Path, rounds: int, repeats: int, threads: int, dtype: str = "float32",
        variants: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    from relpos.ops.native import build

    entries = [p for p in build.prebuilt(root) if p.problem is None and p.runs
               and (variants is None or p.variant in variants)]
    if not entries:
        raise SystemExit(f"relpos: error: {root} holds no variant this CPU runs"
                         + ("" if variants is None else f" among {', '.join(variants)}"))
    clock = common.RunClock()
    with tempfile.TemporaryDirectory() as scratch:
        envs = {"native": {**os.environ, "RELPOS_KERNELS_DIR": ""}}
        for p in entries:  # a directory per variant, holding it alone
            shutil.copytree(p.library.parent, Path(scratch) / p.variant / p.library.parent.name)
            envs[p.variant] = {**os.environ, "RELPOS_KERNELS_DIR": str(Path(scratch) / p.variant)}
        times: dict[str, list[dict[str, float]]] = {name: [] for name in envs}
        gemms: dict[str, dict[str, str]] = {}
        for r in range(rounds):
            for name in (list(envs) if r % 2 == 0 else list(envs)[::-1]):
                said = _one(envs[name], threads, repeats, dtype)
                times[name].append(said["ms"])
                gemms[name] = said["gemms"]
            print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    median = {name: {_key(s): statistics.median(t[_key(s)] for t in runs) for s in SHAPES}
              for name, runs in times.items()}
    columns = [(name, "native") for name in envs if name != "native"]
    rows = []
    for s in SHAPES:
        k = _key(s)
        cells = [f"{s[0]} x {s[1]}{' causal' if s[2] else ''}", f"{median['native'][k]:.1f}"]
        cells += [f"{median[name][k]:.1f} ({median[name][k] / median[base][k]:.2f}x)"
                  for name, base in columns]
        rows.append(cells)
    headers = ["B x n", "native ms", *[f"{name} ms (/ {base})" for name, base in columns]]
    meta = {
        "date": common.report_date(),
        "command": "OMP_WAIT_POLICY=PASSIVE "
                   f"{common.script_command('relpos.bench.kernel_variants')} "
                   f"--rounds {rounds} --repeats {repeats} --threads {threads}"
                   + ("" if dtype == "float32" else f" --dtype {dtype}")
                   + ("" if variants is None else f" --variants {','.join(variants)}"),
        **common.environment(threads),
        "dtype": dtype,
        **{f"{name} GEMMs": ", ".join(f"{d} {e}" for d, e in sorted(engines.items()))
           for name, engines in gemms.items()},
        **clock.meta(),
    }
    return common.markdown_table(headers, rows), meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("build") / "kernel-variants")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants to time (default: every one the CPU runs)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from relpos.ops.native import build
    from relpos.ops.native.variants import variants

    chosen = None if args.variants is None else [v for v in args.variants.split(",") if v]
    known = [v.name for v in variants()]
    if chosen is not None and (not chosen or set(chosen) - set(known)):
        parser.error(f"--variants: unknown {sorted(set(chosen) - set(known))}; allowed: {known}")
    build.build_into(args.dir, chosen)  # keeps the variants already there
    table, meta = run(args.dir, args.rounds, args.repeats, args.threads, args.dtype, chosen)
    name = "kernel_variants.md" if args.dtype == "float32" else "kernel_variants_bf16.md"
    return common.print_report(
        "Native kernels: portable variants against this CPU's build",
        __doc__, meta, table, args.out, name)


if __name__ == "__main__":
    raise SystemExit(main())
