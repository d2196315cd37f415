"""A 6-layer relpos encoder against the same ``nn.TransformerEncoder`` where a new user meets it:
inference in eval mode (torch's fast path on), a padded batch (the padding mask given the way
``nn.TransformerEncoder`` hands it over), and training with torch's default ``dropout=0.1``.

The models are those of ``relpos bench --preset encoder`` (``relpos.bench.encoder.build_models``:
6 layers, E=512, H=8, FF=2048, pre-norm, K=16, the same weights), timed in interleaved rounds
(medians), ratios to the torch model in the same run:

- ``eval``: both models in eval mode under ``torch.inference_mode()``; torch's encoder takes
  its fast path (``enable_nested_tensor=True`` is torch's default, so padded rows become a
  nested tensor there), relpos's layers run their own.
- ``padded``: half of every row's keys are padding, given as a bool ``src_key_padding_mask``
  (``nn.TransformerEncoder`` turns it into a float mask before the layers see it); training
  step (forward + backward), dropout 0.
- ``dropout``: training step with ``dropout=0.1`` in every layer (attention dropout included).

Run from the repository root::

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.encoder_variants --out benchmarks

writes ``encoder_variants.md``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relpos.bench import common, encoder


def _set_dropout(model: nn.Module, p: float) -> None:
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = p
        if isinstance(getattr(mod, "dropout", None), float):
            attn: Any = mod  # nn.MultiheadAttention and relpos's attention read a float
            attn.dropout = p


def _infer(model: nn.Module, x: torch.Tensor, pad: torch.Tensor | None) -> None:
    with torch.inference_mode():
        model(x, src_key_padding_mask=pad)


def _train(model: nn.Module, x: torch.Tensor, pad: torch.Tensor | None, g: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x, src_key_padding_mask=pad).backward(g)


def run(repeats: int, warmup: int) -> tuple[list[str], dict[str, str]]:
    rows = []
    clock = common.RunClock()
    cases = [("eval", 8, 128), ("eval", 1, 1024), ("padded", 8, 512), ("padded", 32, 128),
             ("dropout", 8, 512), ("dropout", 32, 128)]
    for what, B, n in cases:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(B, n, encoder.D_MODEL, generator=gen)
        g = torch.randn(B, n, encoder.D_MODEL, generator=gen)
        pad = None
        plain, relative = encoder.build_models(16, ("auto",))
        rel = relative["auto"]
        if what == "eval":
            plain.eval()
            rel.eval()
            plain.enable_nested_tensor = True
            fns = {"torch": functools.partial(_infer, plain, x, None),
                   "relpos": functools.partial(_infer, rel, x, None)}
        else:
            if what == "padded":
                pad = torch.zeros(B, n, dtype=torch.bool)
                pad[:, n // 2:] = True
            else:
                _set_dropout(plain, 0.1)
                _set_dropout(rel, 0.1)
            fns = {"torch": functools.partial(_train, plain, x, pad, g),
                   "relpos": functools.partial(_train, rel, x, pad, g)}
        medians, failures = common.interleaved_medians(
            {k: [f] for k, f in fns.items()}, warmup=warmup, repeats=repeats, rotate=True)
        assert not failures, failures
        t, r = medians["torch"][0], medians["relpos"][0]
        rows.append([what, f"{B} x {n}", f"{t:.1f}", f"{r:.1f}", f"{r / t:.2f}x"])
        print(rows[-1], file=sys.stderr, flush=True)
    meta = {
        "date": common.report_date(),
        "command": "OMP_WAIT_POLICY=PASSIVE "
                   f"{common.script_command('relpos.bench.encoder_variants')} "
                   f"--repeats {repeats} --warmup {warmup}",
        **common.environment(torch.get_num_threads()),
        **clock.meta(),
    }
    table = common.markdown_table(
        ["case", "B x n", "nn.TransformerEncoder ms", "relpos K=16 ms", "relpos / torch"], rows)
    return table, meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common.add_timing_options(parser, repeats=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    table, meta = run(args.repeats, args.warmup)
    return common.print_report(
        "relpos encoder: inference, padded batches, dropout",
        __doc__, meta, table, args.out, "encoder_variants.md")


if __name__ == "__main__":
    raise SystemExit(main())
