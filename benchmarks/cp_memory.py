"""Context-parallel attention: peak memory per rank and bytes per layer against one process.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cp_memory.py            # writes cp_memory.md
    python benchmarks/cp_memory.py --lengths 4096,16384 --worlds 1,2 --out /tmp/cp.md

For each sequence length n and world size P (ranks as processes on this machine, gloo on
127.0.0.1, one torch thread each) one causal self-attention layer with Shaw tables (K = 64 by
default) runs forward and backward on each rank's shard of ``n / P`` positions
(``relpos.distributed.context_parallel_attention``, ``head_tail`` layout); P = 1 is the
single-process call. Each rank measures the rise of its peak resident memory (``VmHWM``,
reset through ``/proc/self/clear_refs`` after a warm-up call) over its resident memory with
the inputs allocated: what the layer's forward and backward add (saved state, gathered or
visiting shards, gradients). The report gives the largest rise over the ranks, its ratio to
the single process times P (1.0 = memory falls exactly as 1/P), and the bytes each rank
received, counted on the calls to torch.distributed (``relpos.distributed.count_traffic``)
next to the formula (``relpos.distributed.traffic``). Wall times are printed for
completeness only: P processes share this machine's cores, so they say nothing about scaling.

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def rank_main(args: argparse.Namespace) -> int:
    """One rank: warm up, measure one forward + backward, write its numbers as JSON."""
    import torch
    import torch.distributed as dist

    from relpos.distributed import (
        context_parallel_attention,
        count_traffic,
        traffic,
    )

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=3600))
    layout = "head_tail" if world > 1 else "contiguous"
    H, D, K = args.heads, args.dim, args.max_distance
    g = torch.Generator().manual_seed(rank)

    def inputs(n_local: int) -> tuple[torch.Tensor, ...]:
        q, k, v = (torch.randn(1, H, n_local, D, generator=g).requires_grad_()
                   for _ in range(3))
        tk, tv = (torch.randn(2 * K + 1, D, generator=g).requires_grad_() for _ in range(2))
        return q, k, v, tk, tv

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tk: torch.Tensor,
              tv: torch.Tensor) -> torch.Tensor:
        return context_parallel_attention(q, k, v, group=None, max_distance=K, rel_keys=tk,
                                          rel_values=tv, is_causal=True, layout=layout,
                                          mode=args.mode)

    n_local = args.n // world
    want = traffic(args.mode, world=world, batch=1, heads=H, n_local=n_local, head_dim=D,
                   backend="gloo")
    if args.what == "model":
        from relpos.distributed import context_parallel
        from relpos.models import ModelConfig, build_model

        torch.manual_seed(0)  # the same weights on every rank
        model = build_model(ModelConfig(
            vocab_size=256, d_model=H * D, num_layers=args.layers, num_heads=H,
            dim_feedforward=4 * H * D, max_distance=K, causal=True))
        if world > 1:
            context_parallel(model, None, layout=layout, mode=args.mode)

        def step(ids: torch.Tensor) -> torch.Tensor:
            logits = model(ids)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

        step(torch.randint(0, 256, (1, 4 * K), generator=g)).backward()  # warm-up
        model.zero_grad(set_to_none=True)
        ids = torch.randint(0, 256, (1, n_local), generator=g)
        want = traffic(args.mode, world=world, batch=1, heads=H, n_local=n_local, head_dim=D,
                       key_mask=False, backend="gloo")
        want = type(want)(want.forward_calls, want.backward_calls,
                          args.layers * want.forward_bytes, args.layers * want.backward_bytes)
        dist.barrier()
        before = _status_kib("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        with count_traffic(world) as fwd:
            loss = step(ids)
        with count_traffic(world) as bwd:
            loss.backward()
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM")
    else:
        warm = inputs(2 * K)  # loads the kernels, sizes gloo's buffers
        layer(*warm).sum().backward()
        del warm
        q, k, v, tk, tv = inputs(n_local)
        dist.barrier()
        before = _status_kib("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        with count_traffic(world) as fwd:
            out = layer(q, k, v, tk, tv)
        with count_traffic(world) as bwd:
            out.backward(torch.ones_like(out))
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM")
    dist.barrier()
    dist.destroy_process_group()
    Path(args.result).write_text(json.dumps({
        "rank": rank, "rise_mib": (peak - before) / 1024, "seconds": seconds,
        "counted_bytes": [fwd.bytes, bwd.bytes],
        "formula_bytes": [want.forward_bytes, want.backward_bytes],
    }))
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_config(args: argparse.Namespace, n: int, world: int, mode: str) -> list[dict]:
    """Start ``world`` ranks for one configuration; their results, rank by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        # glibc raises its mmap threshold as large blocks are freed (up to 32 MiB), so a
        # process whose tensors are under 32 MiB keeps freed ones on its heap while one with
        # larger tensors returns them: a fixed threshold makes every rank's peak its live
        # tensors, whatever their size.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 17),
               "MALLOC_TRIM_THRESHOLD_": str(1 << 17)}
        procs = []
        for r in range(world):
            cmd = [sys.executable, __file__, "--rank", str(r), "--world", str(world),
                   "--port", str(port), "--n", str(n), "--mode", mode,
                   "--heads", str(args.heads), "--dim", str(args.dim),
                   "-k", str(args.max_distance), "--result", f"{tmp}/{r}.json",
                   "--what", args.what, "--layers", str(args.layers)]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"n={n} P={world} {mode}: a rank failed (exit codes {codes})")
        return [json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(world)]


def report(args: argparse.Namespace, rows: list[dict]) -> str:
    import torch

    from relpos._sysinfo import environment

    env = environment()
    lines = [
        "# Context parallelism: peak memory per rank and bytes per layer",
        "",
        f"`python benchmarks/cp_memory.py` on {env.get('cpu', '?')} "
        f"({env.get('isa', '?')}), {os.cpu_count()} CPUs, torch {torch.__version__}, one "
        f"torch thread per rank, {os.environ.get('OMP_WAIT_POLICY', 'OMP_WAIT_POLICY unset')}"
        f" (OMP_WAIT_POLICY), gloo on 127.0.0.1. One causal layer, B = 1, H = {args.heads}, "
        f"D = {args.dim}, K = {args.max_distance} (keys and values tables), float32, "
        "forward + backward; `head_tail` layout for P > 1.",
        "",
        "glibc's mmap and trim thresholds are fixed at 128 KiB in every rank "
        "(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`), so that freed tensors return "
        "to the system whatever their size and the peak is the live tensors'.",
        "",
        "Rise: the largest over the ranks of the rise of peak resident memory over the "
        "resident memory with the inputs allocated (saved state, visiting or gathered shards, "
        "gradients). x P: rise times P over the single process's rise at that n (1.00 = the "
        "memory per rank falls exactly as 1/P; the target for ring mode at P = 4 is <= 1.2). "
        "Bytes: received by each rank in the layer's forward + backward, counted on the "
        "calls to torch.distributed, and the formula of docs/scaling.md "
        "(`relpos.distributed.traffic`).",
        "",
    ]
    titles = {
        "layer": "## One attention layer (the kernels' own memory plus the ring's buffers)",
        "model": f"## A relpos LM of {args.layers} blocks (d_model = {args.heads * args.dim}, "
                 f"MLP {4 * args.heads * args.dim}, vocabulary 256), cross-entropy loss",
    }
    for what in ("layer", "model"):
        mine = [r for r in rows if r["what"] == what]
        if not mine:
            continue
        lines += ["", titles[what], "",
                  "| n | P | mode | rise MiB | x P | bytes counted | bytes formula | wall s |",
                  "|---|---|---|---|---|---|---|---|"]
        single = {r["n"]: r["rise"] for r in mine if r["world"] == 1}
        for r in mine:
            ratio = r["rise"] * r["world"] / single[r["n"]] if r["n"] in single else \
                float("nan")
            lines.append(
                f"| {r['n']} | {r['world']} | "
                f"{r['mode'] if r['world'] > 1 else 'one process'} | {r['rise']:.1f} | "
                f"{ratio:.2f} | {r['counted']:,} | {r['formula']:,} | {r['seconds']:.1f} |")
    lines += [
        "",
        f"Wall time: {os.cpu_count()} cores shared by P processes, so the seconds above say "
        "nothing about how context parallelism scales; on GPUs each rank has its own device "
        "and ring mode overlaps each step's transfer with the previous step's kernel (see "
        "docs/scaling.md for the cost model).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,16384,65536")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--modes", default="ring,all_gather")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("-k", "--max-distance", type=int, default=64)
    p.add_argument("--what", choices=("layer", "model", "both"), default="both",
                   help="one attention layer, a relpos LM of --layers blocks, or both")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model-lengths", default="4096,16384,65536",
                   help="the lengths of the model runs (--what both)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=str(HERE / "cp_memory.md"))
    # One rank (started by this script):
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ring", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        return rank_main(args)

    from relpos.ops.native import build

    build.load()  # compiled here once; the ranks only load it
    rows = []
    whats = ["layer", "model"] if args.what == "both" else [args.what]
    for what in whats:
        lengths = args.model_lengths if what == "model" and args.what == "both" else \
            args.lengths
        rows += _sweep(argparse.Namespace(**{**vars(args), "what": what}),
                       [int(x) for x in lengths.split(",")])
    text = report(args, rows)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(text)
    return 0


def _sweep(args: argparse.Namespace, lengths: list[int]) -> list[dict]:
    rows = []
    for n in lengths:
        for world in (int(x) for x in args.worlds.split(",")):
            for mode in (args.modes.split(",") if world > 1 else ["ring"]):
                if n % (2 * world):
                    continue
                results = run_config(args, n, world, mode)
                row = {"what": args.what, "n": n, "world": world, "mode": mode,
                       "rise": max(r["rise_mib"] for r in results),
                       "seconds": max(r["seconds"] for r in results),
                       "counted": sum(results[0]["counted_bytes"]),
                       "formula": sum(results[0]["formula_bytes"])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
