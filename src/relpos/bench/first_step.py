"""A process's first training step: its memory and time, relpos against plain SDPA.

Each cell runs in a fresh ``spawn`` subprocess, as a user's first training step does: inputs
made, one 64-token call under ``no_grad`` (loading, evaluating), then the measured forward +
backward, the process's first differentiable call. Reported, above the resident memory taken
after the inputs exist: the peak (``VmHWM``) over that first forward + backward, the resident
memory after it with the output dropped (the gradients of q, k and v kept, for both), the bytes
autograd saved for the backward (``saved_tensors_hooks``), and the first and second call's
times. H = 8, D = 64, K = 64 (shared tables), float32; relpos padded ``(1, H, n, D)`` and
packed ``(n, H, D)`` (one sequence, ``relative_attention_varlen``), auto-selected backend.

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.first_step --out benchmarks

writes ``first_step.md`` and ``first_step.csv``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

from relpos.bench import common, memory

H, D, K, WARMUP = 8, 64, 64, 64
VARIANTS = ("sdpa", "relpos", "relpos packed")
FIELDS = ("peak_mib", "resident_mib", "saved_mib", "first_ms", "second_ms", "backend")


def _cell(variant: str, n: int, causal: bool, threads: int) -> dict[str, Any]:
    """One cell, in this (fresh) process."""
    import torch
    import torch.nn.functional as F

    from relpos.functional import relative_attention, select_backend
    from relpos.varlen import (
        cu_seqlens_from_lengths,
        relative_attention_varlen,
        select_backend_varlen,
    )

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    packed = variant == "relpos packed"

    def inputs(length: int, grad: bool) -> list[Any]:
        shape = (length, H, D) if packed else (1, H, length, D)
        return [torch.randn(*shape, generator=g).requires_grad_(grad) for _ in range(3)]

    rel_keys, rel_values = (torch.randn(2 * K + 1, D, generator=g, requires_grad=True)
                            for _ in range(2))
    tables: dict[str, Any] = {"rel_keys": rel_keys, "rel_values": rel_values}

    def attend(q: Any, k: Any, v: Any) -> Any:
        if variant == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if packed:
            cu = cu_seqlens_from_lengths([q.shape[0]])
            return relative_attention_varlen(q, k, v, cu, cu, max_distance=K,
                                                    is_causal=causal, **tables)
        return relative_attention(q, k, v, max_distance=K, is_causal=causal, **tables)

    q, k, v = inputs(n, True)
    grad_out = torch.randn((*q.shape[:-1], D), generator=g)
    with torch.no_grad():
        attend(*inputs(WARMUP, False))
    backend = "sdpa"
    if variant == "relpos":
        backend = select_backend(q, k, v, max_distance=K, is_causal=causal, **tables)
    elif packed:
        cu = cu_seqlens_from_lengths([n])
        backend = select_backend_varlen(q, k, v, cu, cu, max_distance=K,
                                               is_causal=causal, **tables)
    gc.collect()
    memory.reset_peak()
    base = memory.proc_status_kib("VmRSS") or 0
    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attend(q, k, v)
    out.backward(grad_out)
    first = time.perf_counter() - start
    peak = (memory.proc_status_kib("VmHWM") or 0) - base
    del out
    gc.collect()
    resident = (memory.proc_status_kib("VmRSS") or 0) - base
    inputs_bytes = sum(t.untyped_storage().nbytes() for t in (q, k, v, *tables.values()))
    saved = sum(storages.values())
    for t in (q, k, v, *tables.values()):
        t.grad = None
    start = time.perf_counter()
    attend(q, k, v).backward(grad_out)
    second = time.perf_counter() - start
    return {"peak_mib": peak / 1024, "resident_mib": resident / 1024,
            "saved_mib": saved / 2**20, "saved_beyond_inputs_mib": (saved - inputs_bytes) / 2**20,
            "first_ms": first * 1e3, "second_ms": second * 1e3, "backend": backend}


def _worker(args: tuple[str, int, bool, int], queue: Any) -> None:
    try:
        queue.put(_cell(*args))
    except BaseException as err:  # reported in the table, not raised across processes
        queue.put({"error": f"{type(err).__name__}: {err}"})


def measure(variant: str, n: int, causal: bool, threads: int) -> dict[str, Any]:
    """One cell in a fresh ``spawn`` subprocess."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=((variant, n, causal, threads), queue))
    proc.start()
    try:
        return dict(queue.get())
    finally:
        proc.join()


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relpos.bench.first_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 16384], help="sequence lengths n (default 4096,16384)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write first_step.md/.csv here")
    args = parser.parse_args(argv)
    threads = common.use_threads(args.threads)
    rows, table = [], []
    for n in args.sizes:
        for causal in (False, True):
            cells = {variant: measure(variant, n, causal, threads) for variant in VARIANTS}
            for variant, cell in cells.items():
                if "error" in cell:
                    print(f"{variant} n={n} causal={causal}: {cell['error']}", file=sys.stderr)
                    continue
                rows.append([n, causal, variant, *(cell[f] if isinstance(cell[f], str)
                                                   else round(cell[f], 1) for f in FIELDS)])
                sdpa = cells["sdpa"]
                if variant == "sdpa" or "error" in sdpa:
                    continue
                table.append([
                    str(n), "yes" if causal else "no", f"{variant} ({cell['backend']})",
                    f"{sdpa['peak_mib']:.0f} / {cell['peak_mib']:.0f} "
                    f"({_ratio(cell['peak_mib'], sdpa['peak_mib'])})",
                    f"{sdpa['resident_mib']:.0f} / {cell['resident_mib']:.0f} "
                    f"({cell['resident_mib'] - sdpa['resident_mib']:+.0f} MiB)",
                    f"{sdpa['saved_mib']:.0f} / {cell['saved_mib']:.0f} "
                    f"({_ratio(cell['saved_mib'], sdpa['saved_mib'])})",
                    f"{common.format_ms(sdpa['first_ms'])} / "
                    f"{common.format_ms(sdpa['second_ms'])}",
                    f"{common.format_ms(cell['first_ms'])} / "
                    f"{common.format_ms(cell['second_ms'])}",
                ])
    meta = {"date": common.report_date(), **common.environment(threads),
            "command": common.script_command("relpos.bench.first_step")
            + f" --sizes {','.join(map(str, args.sizes))}"}
    body = common.markdown_table(
        ["n", "causal", "relpos", "peak MiB SDPA / relpos", "resident after MiB SDPA / relpos",
         "saved MiB SDPA / relpos", "SDPA first / second call ms",
         "relpos first / second call ms"], table)
    common.print_report("A process's first training step", __doc__, meta, body, args.out,
                        "first_step.md")
    if args.out:
        common.write_files({args.out / "first_step.csv": common.csv_text(
            ["n", "causal", "variant", *FIELDS], rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
