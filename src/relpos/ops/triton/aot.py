"""Ahead-of-time compilation of the Triton kernels for a GPU that is not there.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 80 or 90, 32))`` lowers a kernel all
the way to PTX and cubin on a machine without a GPU; the compiled object's metadata gives the
shared memory per block, and the PTX assembler that Triton ships (``ptxas -v``) gives the
registers per thread and the bytes spilled. That checks what the interpreter cannot: block
shapes ``tl.dot`` refuses, shared memory over the limit, register spills.

Each configuration of :data:`~relpos.ops.triton.configs.CONFIGS` is compiled with every optional
feature on (keys and values tables, key mask, causal): the variant with the most live state.
Imports Triton.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction

from relpos.ops.triton import configs, kernels

if isinstance(kernels.forward_kernel, InterpretedFunction):
    raise ImportError(
        "relpos.ops.triton.aot compiles for the GPU, but Triton was loaded by its interpreter "
        "(TRITON_INTERPRET=1 when it was first imported); run it in a process without it, "
        "e.g. python -m relpos.ops.triton.aot"
    )

__all__ = ["SHARED_MEMORY_LIMIT", "Resources", "compile_config", "ptxas_resources"]

SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
"""Dynamic shared memory one block may use (bytes): A100 (sm_80) and H100 (sm_90)."""

_SCALARS = ("H", "L", "S", "R", "left", "query_start")


@dataclass(frozen=True)
class Resources:
    shared: int  # bytes of shared memory per block
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes


def _signature(kernel: str, operand: str) -> dict[str, str]:
    """Argument types of ``kernel`` with ``operand`` ("bf16", "fp16", "fp32") inputs."""
    t, acc = f"*{operand}", "*fp32"
    if kernel == "forward":
        ptrs = dict(Q=t, K=t, V=t, QA=acc, AV=t, KM="*u8", Out=t, Lse=acc, Pb=acc, Tab="*i32")
        extra = {"av_head_stride": "i32"}
    else:
        grad = dict(DK=t, DV=t) if kernel == "backward_dkdv" else dict(DQ=acc, DSb=acc)
        ptrs = dict(Q=t, K=t, V=t, QA=acc, DOA=acc, KM="*u8", DO=t, Lse=acc, Delta=acc, **grad,
                    Tab="*i32")
        extra = {}
    return {**ptrs, **dict.fromkeys(_SCALARS, "i32"), "scale": "fp32", **extra}


def ptxas_resources(ptx: str, arch: int, cache: Path | None = None) -> tuple[int, int, int]:
    """``(registers, spill store bytes, spill load bytes)`` from ``ptxas -v`` on ``ptx``,
    remembered in the directory ``cache`` if given."""
    memo = None
    if cache is not None:
        memo = cache / f"ptxas-{hashlib.sha256(f'{arch}{ptx}'.encode()).hexdigest()}.json"
        if memo.exists():
            registers, stores, loads = json.loads(memo.read_text(encoding="utf-8"))
            return registers, stores, loads
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w", encoding="utf-8") as f:
            f.write(ptx)
        log = subprocess.run(
            # the flags Triton's own compile passes (triton/backends/nvidia/compiler.py)
            [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
             f"--gpu-name={sm_arch_from_capability(arch)}", path,
             "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    result = int(registers[1]), int(spills[1]), int(spills[2])
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(result), encoding="utf-8")
    return result


def compile_config(
    kernel: str, block_d: int, dtype_class: str, arch: int,
    cfg: configs.KernelConfig | None = None, *, cache: Path | None = None,
    varlen: bool = False,
) -> Resources:
    """Compile one entry of :data:`~relpos.ops.triton.configs.CONFIGS` (or ``cfg`` in its place)
    for ``sm_{arch}`` and measure it (``cache``: where ``ptxas -v`` results are kept;
    ``varlen``: the packed batches' variant, ``VARLEN=True``)."""
    cfg = configs.CONFIGS[kernel, block_d, dtype_class] if cfg is None else cfg
    operand = "bf16" if dtype_class == "half" else "fp32"
    constants: dict[str, object] = dict(
        HAS_QA=True, HAS_AV=True, HAS_KM=True, CAUSAL=True, ACC=tl.float32, BF16_EMULATED=False,
        VARLEN=varlen, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_d,
        D=block_d, Dv=block_d,
    )
    if kernel == "forward":
        constants["BLOCK_R"] = configs.BLOCK_R
    fn = {"forward": kernels.forward_kernel, "backward_dkdv": kernels.backward_dkdv_kernel,
          "backward_dq": kernels.backward_dq_kernel}[kernel]
    types = _signature(kernel, operand)
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}  # in order
    assert set(signature) == set(types) | set(constants), sorted(signature)
    # As the launcher specializes arguments of a call: pointers 16-byte aligned (torch's
    # allocations are), so loads along the head dim vectorize.
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in signature.items() if kind.startswith("*")}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )
    registers, stores, loads = ptxas_resources(compiled.asm["ptx"], arch, cache)
    return Resources(compiled.metadata.shared, registers, stores, loads)


def main(argv: Sequence[str] | None = None) -> int:
    """Compile configurations and print one JSON line each (``python -m
    relpos.ops.triton.aot --arch 80``); exit status 1 if one is over the limits."""
    parser = argparse.ArgumentParser(description="Compile the triton backend's kernels for a "
                                     "GPU architecture without a GPU; report their resources.")
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_MEMORY_LIMIT), required=True)
    parser.add_argument("--kernel", choices=configs.KERNELS, action="append",
                        help="(repeatable) default: every kernel")
    parser.add_argument("--cache", type=Path, help="directory that keeps ptxas results")
    args = parser.parse_args(argv)
    ok = True
    for (kernel, block_d, dtype_class), cfg in configs.CONFIGS.items():
        if args.kernel and kernel not in args.kernel:
            continue
        r = compile_config(kernel, block_d, dtype_class, args.arch, cache=args.cache)
        within = r.shared <= SHARED_MEMORY_LIMIT[args.arch] and not (r.spill_stores
                                                                     or r.spill_loads)
        ok &= within
        print(json.dumps(dict(kernel=kernel, block_d=block_d, dtype_class=dtype_class,
                              arch=args.arch, config=asdict(cfg), **asdict(r), within=within)),
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
