"""Packed variable-length batches against padded ones, at a real length distribution.

The lengths are those of the functions of CPython's standard library in characters (every
``def`` of the ``.py`` files relpos's corpus reads, ``relpos.training.experiment.corpus``;
its source span, capped at 512), drawn at random (seed 0) until a batch holds about
``--tokens`` real tokens. Padded, every sequence takes the batch's longest length; the
report states the padding fraction that implies.

- ``attention``: one call, H=8, D=64, K=16 (shared tables), forward + backward, float32:
  relpos packed (``relative_attention_varlen``, native kernels) against relpos padded
  (``relative_attention`` with ``key_mask``, native) and against plain SDPA on the same
  padded batch and on the same packed work (one call per sequence, and PyTorch's jagged
  nested tensors; the faster is the ratio's floor, and named).
- ``encoder``: a training step (forward + backward) of 6 relpos encoder layers (E=512, H=8,
  FF=2048, pre-norm, dropout 0, K=16) on the same tokens, packed (``cu_seqlens=``) against
  padded (``src_key_padding_mask``).
- ``decode``: one step of a 6-layer language model (E=512) over 8 caches of different
  lengths: a ``PackedKVCache`` against a ``KVCache`` of the left-padded prompts.

Timed in interleaved rounds (medians), ratios measured in the same run. Run from the
repository root::

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.varlen --out benchmarks

writes ``varlen.md``.
"""

from __future__ import annotations

import argparse
import ast
import functools
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from relpos.bench import common

H, D, K = 8, 64, 16
CAP = 512


@functools.cache
def function_lengths(cap: int = CAP) -> tuple[int, ...]:
    """The character length of every function of the standard library's corpus files,
    capped at ``cap``."""
    from relpos.training.experiment.corpus import default_root, find_sources

    lengths = []
    for path in find_sources(default_root()):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        offsets = [0]
        for line in text.splitlines(keepends=True):
            offsets.append(offsets[-1] + len(line))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                start = offsets[node.lineno - 1] + node.col_offset
                end = offsets[node.end_lineno - 1] + (node.end_col_offset or 0)
                lengths.append(max(1, min(cap, end - start)))
    return tuple(lengths)


def _decode_lengths() -> list[int]:
    """Eight cache lengths drawn from :func:`function_lengths` (seed 2)."""
    rng = random.Random(2)
    pool = function_lengths()
    return [rng.choice(pool) for _ in range(8)]


def draw_batch(tokens: int, seed: int = 0) -> list[int]:
    """Lengths drawn from :func:`function_lengths` until they hold ``tokens`` tokens."""
    pool = function_lengths()
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(rng.choice(pool))
    return lengths


def _attention_cases(lengths: list[int], causal: bool) -> dict[str, Callable[[], None]]:
    from relpos.functional import relative_attention
    from relpos.varlen import cu_seqlens_from_lengths, relative_attention_varlen

    g = torch.Generator().manual_seed(0)
    T, B, Lmax = sum(lengths), len(lengths), max(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    table = torch.randn(2 * K + 1, D, generator=g, requires_grad=True)
    q, k, v = (torch.randn(T, H, D, generator=g, requires_grad=True) for _ in range(3))
    pq, pk, pv = (torch.randn(B, H, Lmax, D, generator=g, requires_grad=True) for _ in range(3))
    key_mask = torch.arange(Lmax)[None, :] < torch.tensor(lengths)[:, None]  # (B, Lmax)
    sdpa_mask = key_mask[:, None, None, :]
    if causal:
        sdpa_mask = sdpa_mask & torch.ones(Lmax, Lmax, dtype=torch.bool).tril()
    splits = [t.detach().split(lengths) for t in (q, k, v)]
    per_seq = [[s.transpose(0, 1).unsqueeze(0).requires_grad_() for s in parts]
               for parts in splits]
    nested = [torch.nested.nested_tensor(list(parts), layout=torch.jagged,  # (B, j, H, D)
                                         requires_grad=True) for parts in splits]

    def run(out: torch.Tensor) -> None:
        out.sum().backward()

    def relpos_packed() -> None:
        run(relative_attention_varlen(q, k, v, cu, cu, max_distance=K, rel_keys=table,
                                      rel_values=table, is_causal=causal))

    def relpos_padded() -> None:
        run(relative_attention(pq, pk, pv, max_distance=K, rel_keys=table, rel_values=table,
                               key_mask=key_mask, is_causal=causal))

    def sdpa_padded() -> None:
        run(F.scaled_dot_product_attention(pq, pk, pv, attn_mask=sdpa_mask))

    def sdpa_per_sequence() -> None:
        outs = [F.scaled_dot_product_attention(a, b, c, is_causal=causal)
                for a, b, c in zip(*per_seq, strict=True)]
        run(torch.cat([o.sum().view(1) for o in outs]))

    def sdpa_nested() -> None:
        a, b, c = (t.transpose(1, 2) for t in nested)  # (B, H, j, D)
        run(F.scaled_dot_product_attention(a, b, c, is_causal=causal).values())

    return {"relpos packed": relpos_packed, "relpos padded": relpos_padded,
            "SDPA padded": sdpa_padded, "SDPA per sequence": sdpa_per_sequence,
            "SDPA nested (jagged)": sdpa_nested}


def _encoder_cases(lengths: list[int]) -> dict[str, Callable[[], None]]:
    from relpos.modules import RelativeTransformerEncoderLayer
    from relpos.varlen import pack

    E = 512
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        RelativeTransformerEncoderLayer(E, 8, 2048, dropout=0.0, batch_first=True,
                                        norm_first=True, max_distance=K) for _ in range(6))
    g = torch.Generator().manual_seed(0)
    B, Lmax = len(lengths), max(lengths)
    x = torch.randn(B, Lmax, E, generator=g)
    padding = torch.arange(Lmax)[None, :] >= torch.tensor(lengths)[:, None]
    packed, cu = pack(x, padding)

    def padded_step() -> None:
        layers.zero_grad(set_to_none=True)
        h = x
        for layer in layers:
            h = layer(h, src_key_padding_mask=padding)
        h[~padding].sum().backward()

    def packed_step() -> None:
        layers.zero_grad(set_to_none=True)
        h = packed
        for layer in layers:
            h = layer(h, cu_seqlens=cu)
        h.sum().backward()

    return {"relpos packed": packed_step, "relpos padded": padded_step}


def _decode_cases(lengths: list[int]) -> dict[str, Callable[[], None]]:
    from relpos.models import ModelConfig, RelativeTransformerLM
    from relpos.varlen import cu_seqlens_from_lengths

    torch.manual_seed(0)
    model = RelativeTransformerLM(ModelConfig(
        vocab_size=256, d_model=512, num_heads=8, num_layers=6, max_distance=K)).eval()
    g = torch.Generator().manual_seed(0)
    B, P = len(lengths), max(lengths)
    ids = torch.randint(0, 256, (B, P), generator=g)
    real = torch.arange(P)[None, :] >= P - torch.tensor(lengths)[:, None]  # left padding
    token = torch.randint(0, 256, (B,), generator=g)
    with torch.inference_mode():
        padded_cache = model.new_cache()
        model(ids, key_mask=real, cache=padded_cache)
        packed_cache = model.new_packed_cache(B)
        model(ids[real], cu_seqlens=cu_seqlens_from_lengths(lengths),
              cache=packed_cache)
    step_cu = torch.arange(B + 1)

    def padded_step() -> None:
        with torch.inference_mode():
            model(token[:, None], cache=padded_cache)

    def packed_step() -> None:
        with torch.inference_mode():
            model(token, cu_seqlens=step_cu, cache=packed_cache)

    return {"relpos packed": packed_step, "relpos padded": padded_step}


def run(tokens: int, encoder_tokens: int, repeats: int, warmup: int
        ) -> tuple[list[str], dict[str, str]]:
    clock = common.RunClock()
    lines: list[str] = []
    lengths = draw_batch(tokens)
    pool = function_lengths()
    pad = 1 - sum(lengths) / (len(lengths) * max(lengths))
    lines += [f"Functions in the corpus: {len(pool)}; median length "
              f"{sorted(pool)[len(pool) // 2]} characters, "
              f"{sum(n == CAP for n in pool) / len(pool):.0%} capped at {CAP}.", "",
              f"**attention** batch: {len(lengths)} sequences, {sum(lengths)} real tokens, "
              f"longest {max(lengths)}; padded to it, {pad:.0%} of the positions are "
              f"padding ({len(lengths) * max(lengths)} positions).", ""]
    rows = []
    for causal in (False, True):
        cases = _attention_cases(lengths, causal)
        medians, failures = common.interleaved_medians(
            {k: [f] for k, f in cases.items()}, warmup=warmup, repeats=repeats,
            rotate=True, errors=(RuntimeError, NotImplementedError))
        assert "relpos packed" in medians and "relpos padded" in medians, failures
        ms = {k: v[0] for k, v in medians.items()}
        floor_name = min((k for k in ("SDPA per sequence", "SDPA nested (jagged)") if k in ms),
                         key=ms.__getitem__)
        rows.append([
            "causal" if causal else "bidirectional",
            *(f"{ms[k]:.1f}" if k in ms else f"fails: {failures[k]}" for k in cases),
            f"{ms['relpos packed'] / ms['relpos padded']:.2f}x",
            f"{ms['relpos packed'] / ms[floor_name]:.2f}x ({floor_name})",
        ])
        print(rows[-1], file=sys.stderr, flush=True)
    lines += common.markdown_table(
        ["mask", *(f"{k} ms" for k in _attention_cases([1], False)),
         "packed / padded relpos", "packed / packed SDPA (faster)"], rows)
    enc_lengths = draw_batch(encoder_tokens, seed=1)
    enc_pad = 1 - sum(enc_lengths) / (len(enc_lengths) * max(enc_lengths))
    cases = _encoder_cases(enc_lengths)
    medians, failures = common.interleaved_medians(
        {k: [f] for k, f in cases.items()}, warmup=warmup, repeats=repeats, rotate=True)
    assert not failures, failures
    ms = {k: v[0] for k, v in medians.items()}
    lines += ["", f"**encoder** batch: {len(enc_lengths)} sequences, {sum(enc_lengths)} real "
              f"tokens, longest {max(enc_lengths)}; padded, {enc_pad:.0%} padding: the linear "
              f"layers do {1 / (1 - enc_pad):.2f}x the real tokens' work padded.", ""]
    lines += common.markdown_table(
        ["6 layers, E=512, fwd + bwd", "relpos packed ms", "relpos padded ms",
         "padded / packed (speed-up)"],
        [["training step", f"{ms['relpos packed']:.1f}", f"{ms['relpos padded']:.1f}",
          f"{ms['relpos padded'] / ms['relpos packed']:.2f}x"]])
    dec_lengths = _decode_lengths()
    cases = _decode_cases(dec_lengths)
    medians, failures = common.interleaved_medians(
        {k: [f] for k, f in cases.items()}, warmup=warmup, repeats=repeats * 4, rotate=True)
    assert not failures, failures
    ms = {k: v[0] for k, v in medians.items()}
    lines += ["", f"**decode** step: one new token for each of {len(dec_lengths)} cached "
              f"sequences of lengths {dec_lengths} (a 6-layer LM, E=512, H=8, K={K}, "
              "inference): packed (`PackedKVCache`, `cu_seqlens=`) against padded (`KVCache` "
              f"of the left-padded prompts, {max(dec_lengths)} positions each, with a key "
              "mask); both through the modules.", ""]
    lines += common.markdown_table(
        ["decode step", "relpos packed ms", "relpos padded ms", "packed / padded"],
        [["8 caches", f"{ms['relpos packed']:.2f}", f"{ms['relpos padded']:.2f}",
          f"{ms['relpos packed'] / ms['relpos padded']:.2f}x"]])
    meta = {
        "date": common.report_date(),
        "command": "OMP_WAIT_POLICY=PASSIVE "
                   f"{common.script_command('relpos.bench.varlen')} --tokens {tokens} "
                   f"--encoder-tokens {encoder_tokens} --repeats {repeats} --warmup {warmup}",
        **common.environment(torch.get_num_threads()),
        **clock.meta(),
    }
    return lines, meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--encoder-tokens", type=int, default=4096)
    common.add_timing_options(parser, repeats=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lines, meta = run(args.tokens, args.encoder_tokens, args.repeats, args.warmup)
    return common.print_report(
        "Packed variable-length batches against padded ones",
        __doc__, meta, lines, args.out, "varlen.md")


if __name__ == "__main__":
    raise SystemExit(main())
