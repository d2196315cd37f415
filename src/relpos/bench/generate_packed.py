"""``RelativeTransformerLM.generate_packed`` against ``generate``: the same prompts, weights and
new tokens, end to end (prefill and every step).

A small float32 language model with random weights (d_model 256, 4 heads, 4 layers, K=16, a
vocabulary of 1000), greedy, no end token (every sequence runs every step), timed in
interleaved rounds with the order rotating (medians): ``generate`` on the prompts as one
batch (left-padded to the longest with a ``key_mask`` when their lengths differ),
``generate_packed`` on the list (a packed prefill, then steps on the same fast decoder), and
the packed steps through the modules over a ``PackedKVCache`` (what ``generate_packed`` ran
before it used the fast decoder). The cases: 8 prompts of 64 tokens, 8 prompts of 8..256
tokens; 64 new tokens each. Every function's tokens are checked equal to ``generate``'s.

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.generate_packed \
        --out benchmarks/generate_packed_epyc.md
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from relpos.bench import common
from relpos.models import ModelConfig, RelativeTransformerLM
from relpos.models.generation import left_pad

VOCAB = 1000
CONFIG = dict(vocab_size=VOCAB, d_model=256, num_heads=4, num_layers=4, max_distance=16)
CASES = {"equal": [64] * 8, "mixed": [8, 40, 72, 104, 136, 168, 200, 256]}


def _generate(model: RelativeTransformerLM, ids: Tensor, mask: Tensor | None, n: int
              ) -> list[list[int]]:
    return model.generate(ids, n, top_k=1, key_mask=mask, new_tokens_only=True).tolist()


def _generate_packed(model: RelativeTransformerLM, prompts: list[Tensor], n: int
                     ) -> list[list[int]]:
    return [t.tolist() for t in model.generate_packed(prompts, n, top_k=1)]


@torch.no_grad()
def _module_steps(model: RelativeTransformerLM, prompts: list[Tensor], n: int
                  ) -> list[list[int]]:
    """Greedy packed steps through the modules over a PackedKVCache (no end token)."""
    lengths = [len(p) for p in prompts]
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    cache = model.new_packed_cache(len(prompts), capacity=max(lengths) + n, growable=False)
    logits = model(torch.cat(prompts), cu_seqlens=cu, cache=cache)[cu[1:] - 1]
    step_cu = torch.arange(len(prompts) + 1)
    out = []
    for i in range(n):
        token = logits.argmax(-1)
        out.append(token)
        if i + 1 < n:
            logits = model(token, cu_seqlens=step_cu, cache=cache)
    return torch.stack(out, 1).tolist()


def run(repeats: int, warmup: int, new_tokens: int, threads: int | None = None
        ) -> tuple[list[str], dict[str, str]]:
    clock = common.RunClock()
    torch.manual_seed(0)
    model = RelativeTransformerLM(ModelConfig(**CONFIG)).eval()  # type: ignore[arg-type]
    rows = []
    for case, lengths in CASES.items():
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
        ids, mask = left_pad(prompts)
        fns: dict[str, Callable[[], list[list[int]]]] = {
            "generate": functools.partial(_generate, model, ids, mask, new_tokens),
            "generate_packed": functools.partial(_generate_packed, model, prompts, new_tokens),
            "module steps": functools.partial(_module_steps, model, prompts, new_tokens),
        }
        want = fns["generate"]()
        for name, fn in fns.items():
            if fn() != want:
                raise AssertionError(f"{case}: {name} gave other tokens than generate")
        medians, failures = common.interleaved_medians(
            {k: [f] for k, f in fns.items()}, warmup=warmup, repeats=repeats, rotate=True)
        assert not failures, failures
        base = medians["generate"][0]
        shape = f"{len(lengths)} x {min(lengths)}..{max(lengths)}" if mask is not None \
            else f"{len(lengths)} x {lengths[0]}"
        for name in fns:
            ms = medians[name][0]
            rows.append([case, shape, str(new_tokens), name, common.format_ms(ms),
                         f"{ms / base:.2f}x"])
            print(rows[-1], file=sys.stderr, flush=True)
    meta = {
        "date": common.report_date(),
        "command": "OMP_WAIT_POLICY=PASSIVE "
                   f"{common.script_command('relpos.bench.generate_packed')} "
                   f"--repeats {repeats} --warmup {warmup} --new-tokens {new_tokens}"
                   + ("" if threads is None else f" --threads {threads}"),
        **common.environment(torch.get_num_threads()),
        **clock.meta(),
    }
    table = common.markdown_table(
        ["case", "prompts", "new tokens", "function", "ms", "/ generate"], rows)
    return table, meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common.add_timing_options(parser, repeats=7)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="a directory (generate_packed.md in it) or a .md file")
    args = parser.parse_args(argv)
    common.use_threads(args.threads)
    table, meta = run(args.repeats, args.warmup, args.new_tokens, args.threads)
    out, name = args.out, "generate_packed.md"
    if out is not None and out.suffix == ".md":
        out, name = out.parent, out.name
    return common.print_report(
        "generate_packed against generate", __doc__, meta, table, out, name)


if __name__ == "__main__":
    raise SystemExit(main())
