"""w2v-BERT 2.0 through relpos against stock Hugging Face attention (forward time, peak memory).

The architecture of w2v-BERT 2.0 / SeamlessM4T v2's speech encoder (hidden 1024, 16 heads,
FFN 4096, depthwise kernel 31, relative_key window (64, 8)), random weights built from the
config (nothing is downloaded), float32, batch 1. Every case runs in a fresh subprocess, so
its peak memory is its own: peak RSS (``VmHWM``, reset after the model and the input exist)
minus the RSS at that point. Variants: ``eager`` and ``sdpa`` (transformers' attention
implementations, which build an (L, S, head_size) embedding and an (H, L, S) bias per layer)
and ``relpos`` (the sdpa model after ``relpos.integrations.transformers.patch``).

    python -m relpos.bench.w2v_bert --out benchmarks/w2v_bert_xeon.md    # the full study
    python -m relpos.bench.w2v_bert --quick                               # a smoke run

Needs the ``transformers`` extra. Set ``OMP_WAIT_POLICY=PASSIVE`` on a shared machine (the
report records it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from relpos import _sysinfo as sysinfo
from relpos.bench import common, memory

FULL = [  # (layers, frames, mode, variants), cheapest first
    (24, 1500, "forward", ("eager", "sdpa", "relpos")),
    (2, 30000, "forward", ("eager", "sdpa", "relpos")),
    (24, 6000, "forward", ("eager", "sdpa", "relpos")),
    (24, 1500, "forward+backward", ("eager", "sdpa", "relpos")),
]
QUICK = [(2, 300, "forward", ("eager", "sdpa", "relpos")),
         (2, 300, "forward+backward", ("sdpa", "relpos"))]


def _status_kib(field: str) -> int:
    kib = memory.proc_status_kib(field)
    if kib is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return kib


def run_case(layers: int, frames: int, mode: str, variant: str, repeats: int) -> dict:
    """One case in this process: build, then time ``repeats`` calls after one warm-up."""
    import torch
    from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

    from relpos.integrations.transformers import patch

    torch.manual_seed(0)
    config = Wav2Vec2BertConfig(
        hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
        intermediate_size=4096, feature_projection_input_dim=160,
        conv_depthwise_kernel_size=31, position_embeddings_type="relative_key",
        left_max_position_embeddings=64, right_max_position_embeddings=8,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, layerdrop=0.0, apply_spec_augment=False)
    config._attn_implementation = "eager" if variant == "eager" else "sdpa"
    model = Wav2Vec2BertModel(config)
    if variant == "relpos":
        patch(model)
    model.train(mode != "forward")
    x = torch.randn(1, frames, 160)

    def call() -> None:
        if mode == "forward":
            with torch.no_grad():
                model(x)
        else:
            model.zero_grad(set_to_none=True)
            model(x).last_hidden_state.square().mean().backward()

    base_kib = _status_kib("VmRSS")
    memory.reset_peak()  # VmHWM back to the current RSS
    times = []
    try:
        for n in range(repeats + (1 if repeats > 1 else 0)):
            start = time.perf_counter()
            call()
            if repeats == 1 or n > 0:  # the first call of several is a warm-up
                times.append(time.perf_counter() - start)
    except (RuntimeError, MemoryError) as err:
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    peak_mib = (_status_kib("VmHWM") - base_kib) / 1024
    return {"seconds": statistics.median(times), "runs": len(times), "peak_mib": peak_mib}


def _subprocess(layers: int, frames: int, mode: str, variant: str, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "relpos.bench.w2v_bert", "--case",
           json.dumps([layers, frames, mode, variant, repeats])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1][:160]
        reason = "killed (out of memory)" if proc.returncode in (-9, 137) else tail
        return {"error": f"exit {proc.returncode}: {reason}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _report(args: argparse.Namespace, rows: list, clock: common.RunClock) -> str:
    import transformers

    env = sysinfo.environment()
    lines = [
        "# w2v-BERT 2.0 architecture: stock transformers attention against relpos",
        "",
        f"- **date**: {common.report_date()}",
        f"- **command**: `{sysinfo.OMP_ENV}={env['omp_wait_policy']} "
        f"{common.script_command('relpos.bench.w2v_bert')}{' --quick' if args.quick else ''}"
        f"{' --out ' + str(args.out) if args.out else ''}`",
        f"- **machine**: {env['cpu']} ({env['isa']}), {env['logical_cpus']} logical CPUs, "
        f"{env['platform']}",
        f"- **versions**: torch {env['torch']}, transformers {transformers.__version__}, "
        f"Python {env['python']}",
        f"- **threads**: {env['threads']} (torch default)",
        "- **model**: hidden 1024, 16 heads, FFN 4096, kernel 31, window (64, 8), random "
        "weights, float32, batch 1",
        f"- **timing**: {args.repeats} timed call(s) per case"
        f"{' after one warm-up call (median)' if args.repeats > 1 else ', no warm-up'} "
        "(one call for 3000 frames and more); each case in a fresh process",
        "- **memory**: peak RSS above the RSS once the model and input exist (VmHWM)",
        f"- **wall time so far**: {clock.minutes():.1f} min; 1-minute load "
        f"average {os.getloadavg()[0]:.1f} when written",
        "",
        "| layers | frames | mode | variant | seconds | peak MiB | relpos speed-up | "
        "relpos memory / stock |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layers, frames, mode, results in rows:
        ours = results.get("relpos", {})
        for variant, r in results.items():
            if "error" in r:
                lines.append(f"| {layers} | {frames} | {mode} | {variant} | - | - | - | "
                             f"did not run: {r['error']} |")
                continue
            speed = mem = "-"
            if variant != "relpos" and "seconds" in ours:
                speed = f"{r['seconds'] / ours['seconds']:.2f}x"
                mem = f"{ours['peak_mib'] / r['peak_mib']:.2f}"
            lines.append(f"| {layers} | {frames} | {mode} | {variant} | {r['seconds']:.2f} | "
                         f"{r['peak_mib']:.0f} | {speed} | {mem} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown report here (after every "
                        "configuration, so an interrupted run keeps what it measured)")
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed calls per case under 3000 frames (after one warm-up call "
                             "when more than 1)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(*json.loads(args.case))))
        return 0
    rows: list = []
    clock = common.RunClock()
    for layers, frames, mode, variants in QUICK if args.quick else FULL:
        results = {}
        for variant in variants:
            repeats = args.repeats if frames < 3000 else 1
            t0 = time.time()
            results[variant] = _subprocess(layers, frames, mode, variant, repeats)
            print(f"{layers} layers, {frames} frames, {mode}, {variant}: {results[variant]} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        rows.append((layers, frames, mode, results))
        text = _report(args, rows, clock)
        if args.out:
            from relpos._io import atomic_write_text

            atomic_write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
