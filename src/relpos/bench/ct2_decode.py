"""relpos against CTranslate2 on the same language model: decoding and a long forward.

One random-weight :class:`relpos.models.RelativeTransformerLM` (default: 6 layers, d_model
512, 8 heads, FF 2048, K=16, vocabulary 1000) is exported with
:func:`relpos.export.to_ctranslate2` (float32 and int8) and both engines then run, in one
process, interleaved round by round, medians:

* greedy decoding of ``--new-tokens`` tokens after a ``--prompt``-token prompt, batch 1 and
  8, at each thread count: relpos ``model.generate(..., temperature=0)`` (the
  :class:`relpos.models.decoding.StepDecoder` loop) against ``Generator.generate_batch``
  (float32 and int8 weights); ms per new token, prefill included for both;
* one forward pass over ``--forward-length`` tokens (batch 1): time and, each in a fresh
  subprocess, the peak resident memory it adds.

The greedy tokens of relpos and CTranslate2 float32 are compared on every case. relpos has
no int8 path (its linears stay float32), so the int8 column is CTranslate2's only.

Needs the ``ct2`` extra (``pip install 'relpos[ct2]'``). Benchmark, not a test::

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.ct2_decode --out benchmarks/ct2_decode_xeon.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from relpos.bench import memory
from relpos.bench.common import (
    add_timing_options,
    csv_text,
    environment,
    interleaved_medians,
    markdown_table,
    script_command,
    write_files,
)
from relpos.export.ctranslate2 import (
    generate_new_tokens,
    load_generator,
    require_ctranslate2,
    to_ctranslate2,
)
from relpos.models import ModelConfig, RelativeTransformerLM


def build_model(args: argparse.Namespace) -> RelativeTransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
        num_heads=args.heads, dim_feedforward=4 * args.d_model, max_distance=args.k,
    )
    model = RelativeTransformerLM(cfg).eval()
    with torch.no_grad():  # tables away from zero so the relative terms matter
        for layer in model.layers:
            attn: Any = layer.self_attn
            for table in (attn.rel_keys, attn.rel_values):
                table.normal_(0.0, 0.5)
    return model


def rss_mib() -> float:
    """Peak resident memory of this process since the last :func:`reset_peak` (MiB)."""
    return memory.rss_peak_bytes() / 2**20


def reset_peak() -> float:
    """Reset the peak to the current resident memory (Linux ``clear_refs`` 5); returns it."""
    memory.reset_peak()
    return rss_mib()


def memory_child(engine: str, directory: str, length: int, threads: int) -> None:
    """Print the peak RSS a forward adds (MiB) and its time (s), as JSON: the second of two
    forwards at full length (the first warms up), its peak above the resident memory before
    it."""
    torch.set_num_threads(threads)
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(0))
    if engine == "relpos":
        from relpos.export import load_module

        model = load_module(directory)
        with torch.no_grad():
            model(ids)  # warm-up at full length: first-touch page faults, kernel choices
            base = reset_peak()
            start = time.perf_counter()
            model(ids)
    else:
        gen = load_generator(directory, intra_threads=threads)
        tokens = [[str(int(i)) for i in ids[0]]]
        gen.forward_batch(tokens)  # warm-up at full length
        base = reset_peak()
        start = time.perf_counter()
        gen.forward_batch(tokens)
    seconds = time.perf_counter() - start
    print(json.dumps({"added_mib": rss_mib() - base, "seconds": seconds}))


def measure_memory(engine: str, directory: Path, length: int, threads: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "relpos.bench.ct2_decode", "--_memory", engine, str(directory),
         str(length), str(threads)], capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{engine} forward failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_decode(
    model: RelativeTransformerLM, gens: dict[str, Any], prompt: torch.Tensor, new_tokens: int,
    warmup: int, repeats: int,
) -> tuple[dict[str, float], bool]:
    """Greedy decoding of ``new_tokens`` after ``prompt`` (B, P) by relpos and CTranslate2
    (``gens``: float32 ``"f32"`` and ``"int8"`` generators), interleaved, medians: ms per new
    token of ``"relpos"``, ``"ct2 float32"`` and ``"ct2 int8"``, and whether relpos's tokens
    and CTranslate2 float32's agree."""
    tokens = [[str(int(i)) for i in row] for row in prompt]
    outs: dict[str, list] = {}

    def rel() -> None:
        outs["relpos"] = model.generate(
            prompt, new_tokens, temperature=0, new_tokens_only=True).tolist()

    def c32() -> None:
        outs["ct2"] = generate_new_tokens(gens["f32"], tokens, new_tokens)

    def c8() -> None:
        generate_new_tokens(gens["int8"], tokens, new_tokens)

    med, _ = interleaved_medians(
        {"relpos": [rel], "ct2 float32": [c32], "ct2 int8": [c8]},
        warmup=warmup, repeats=repeats, rotate=True,
    )
    return {k: v[0] / new_tokens for k, v in med.items()}, outs["relpos"] == outs["ct2"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("-k", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    add_timing_options(p, repeats=3)
    p.add_argument("--forward-length", type=int, default=2048,
                   help="tokens of the timed forward pass (0: decoding only)")
    p.add_argument("--out", type=Path, default=None, help="markdown report (and .csv beside)")
    p.add_argument("--_memory", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._memory:
        engine, directory, length, threads = args._memory
        memory_child(engine, directory, int(length), int(threads))
        return 0
    lowest = {"layers": 1, "d_model": 1, "heads": 1, "k": 0, "vocab": 2, "prompt": 1,
              "new_tokens": 1, "repeats": 1, "warmup": 0, "forward_length": 0}
    for name, low in lowest.items():
        if getattr(args, name) < low:
            flag = "-k" if name == "k" else "--" + name.replace("_", "-")
            p.error(f"{flag} must be >= {low}, got {getattr(args, name)}")
    if args.d_model % args.heads:
        p.error(f"--d-model must be a multiple of --heads, got {args.d_model} and {args.heads}")
    counts = {}
    for flag in ("--batches", "--threads"):
        text = getattr(args, flag[2:])
        try:
            counts[flag] = [int(v) for v in text.split(",")]
        except ValueError:
            counts[flag] = []
        if not counts[flag] or min(counts[flag]) < 1:
            p.error(f"{flag} must be comma-separated ints >= 1, got {text!r}")
    ct2 = require_ctranslate2()
    model = build_model(args)
    batches, thread_counts = counts["--batches"], counts["--threads"]
    N, P = args.new_tokens, args.prompt
    work = Path(tempfile.mkdtemp(prefix="relpos_ct2_"))
    from relpos.export import save_module

    save_module(model, work / "model.pt")
    to_ctranslate2(model, work / "f32")
    to_ctranslate2(model, work / "int8", quantization="int8")
    rows, csv_rows, agree_all = [], [], True
    for threads in thread_counts:
        torch.set_num_threads(threads)
        gens = {q: load_generator(work / q, intra_threads=threads) for q in ("f32", "int8")}
        for B in batches:
            prompt = torch.randint(0, args.vocab, (B, P),
                                   generator=torch.Generator().manual_seed(B))
            ms, agree = time_decode(model, gens, prompt, N, args.warmup, args.repeats)
            agree_all &= agree
            ratio = ms["relpos"] / ms["ct2 float32"]
            rows.append([f"decode, batch {B}", str(threads), f"{ms['relpos']:.2f} ms/token",
                         f"{ms['ct2 float32']:.2f} ms/token", f"**{ratio:.2f}x**",
                         f"{ms['ct2 int8']:.2f} ms/token", "yes" if agree else "NO"])
            csv_rows.append(["decode", B, threads, ms["relpos"], ms["ct2 float32"],
                             ms["ct2 int8"], agree])
            print(rows[-1], flush=True)
        del gens
    for threads in thread_counts if args.forward_length else ():
        L = args.forward_length
        r = [measure_memory("relpos", work / "model.pt", L, threads) for _ in range(args.repeats)]
        c = [measure_memory("ct2", work / "f32", L, threads) for _ in range(args.repeats)]
        rs = sorted(x["seconds"] for x in r)[len(r) // 2]
        cs = sorted(x["seconds"] for x in c)[len(c) // 2]
        rm = max(x["added_mib"] for x in r)
        cm = max(x["added_mib"] for x in c)
        rows.append([f"{L}-token forward", str(threads), f"{rs:.2f} s, +{rm:.0f} MiB",
                     f"{cs:.2f} s, +{cm:.0f} MiB", f"**{rs / cs:.2f}x** ({cs / rs:.1f}x faster)",
                     "", ""])
        csv_rows.append(["forward", 1, threads, rs, cs, "", ""])
        print(rows[-1], flush=True)
    meta = environment(torch.get_num_threads())
    meta["threads"] = ", ".join(map(str, thread_counts)) + " (torch intra-op = CT2 intra_threads)"
    meta["ctranslate2"] = ct2.__version__
    meta["model"] = (f"{args.layers} layers, d_model {args.d_model}, {args.heads} heads, FF "
                     f"{4 * args.d_model}, K={args.k}, vocabulary {args.vocab}, random weights, "
                     "float32")
    meta["decode"] = f"greedy, {N} new tokens after a {P}-token prompt, prefill included"
    meta["rounds"] = f"{args.warmup} warm-up + {args.repeats} measured, interleaved, medians"
    meta["command"] = f"{script_command('relpos.bench.ct2_decode')} " + " ".join(sys.argv[1:])
    head = ["case", "threads", "relpos", "CT2 float32", "relpos / CT2", "CT2 int8",
            "greedy tokens agree"]
    lines = ["# relpos against CTranslate2: decoding and a long forward", ""]
    lines += [f"- **{k}**: {v}" for k, v in meta.items()]
    lines += ["", *markdown_table(head, rows), ""]
    lines.append(f"Greedy tokens identical in every decode case: {'yes' if agree_all else 'NO'}.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        csv = csv_text(["case", "batch", "threads", "relpos", "ct2_f32", "ct2_int8", "agree"],
                       csv_rows)
        write_files({args.out: text, args.out.with_suffix(".csv"): csv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
