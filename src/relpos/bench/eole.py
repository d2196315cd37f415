"""An eole Transformer NMT model with Shaw relative positions: stock eole 0.6.4 against the same
model after ``relpos.integrations.eole.patch`` (training step, beam-search translation, peak
memory, and how far each one's cached decoding is from its own full forward).

The model: eole's ``TransformerModelConfig`` with 6 encoder + 6 decoder layers, d_model 512,
8 heads, FFN 2048, ``position_encoding_type: Relative`` with ``n_positions: 20`` (K = 20), a
shared vocabulary of 8000, float32, dropout 0, random weights from eole's own
``xavier_uniform`` initialization (nothing is downloaded).

- **training step**: forward, cross-entropy over the target, backward (the optimizer step is
  the same for both and left out), on batches of about 4096 source and 4096 target tokens at
  sentence lengths 32-256 (B x n = 128 x 32 ... 16 x 256), stock and patched interleaved round
  by round (the order rotating), median of the measured rounds;
- **one self-attention layer**: the module the patch replaces, forward + backward on its own
  at the same shapes (encoder: padding mask; decoder: causal mask), interleaved likewise;
- **translation**: eole's ``Translator`` (its KV cache, dynamic shapes), beam 4, a batch of
  16 sentences of 32 tokens, 32 target tokens each (``min_length`` keeps the batch whole);
- **peak memory** of a 2048-token document (source and target 2048 tokens, batch 1), each case
  in a fresh subprocess (``relpos.bench.memory``); forward + backward of the full model for the
  patched one, and of 1 + 1 layers for both (stock's full 6 + 6 does not fit here), and the
  no-grad forward of the full model for both;
- **decoding error**: greedy translation through eole's ``Translator``; the largest difference
  between the log-probabilities it computed with its cache and the model's teacher-forced
  log-probabilities of the same tokens.

    OMP_WAIT_POLICY=PASSIVE python -m relpos.bench.eole --out benchmarks/eole_xeon.md
    python -m relpos.bench.eole --quick          # a smoke run (2 + 2 layers, small sizes)

Needs the ``eole`` extra.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any

from relpos.bench import common, memory

VOCAB = 8000
PAD, BOS, EOS = 1, 2, 3


def _vocabs(size: int) -> dict:
    from eole.inputters.inputter import dict_to_vocabs

    tokens = ["<unk>", "<blank>", "<s>", "</s>"] + [f"w{i}" for i in range(size - 4)]
    return dict_to_vocabs({
        "src": tokens, "tgt": tokens, "decoder_start_token": "<s>",
        "specials": {"bos_token": "<s>", "pad_token": "<blank>", "eos_token": "</s>",
                     "unk_token": "<unk>"},
    })


def build(layers: int, vocab: int, variant: str, d_model: int = 512) -> Any:
    """The eole model, stock or patched, in training mode (dropout 0)."""
    import torch
    from eole.config.models import TransformerModelConfig
    from eole.models.model import EncoderDecoderModel

    import relpos.integrations.eole as rp_eole

    config = TransformerModelConfig(
        hidden_size=d_model, heads=8, transformer_ff=4 * d_model, layers=layers,
        max_position_embeddings=4096,
        embeddings={"word_vec_size": d_model, "position_encoding_type": "Relative",
                    "n_positions": 20},
    )
    torch.manual_seed(0)
    model = EncoderDecoderModel.build(config, _vocabs(vocab), None)
    model.init_weights(types.SimpleNamespace(param_init_method="xavier_uniform"))
    if variant == "patched":
        rp_eole.patch(model)
    return model.train()


def _step_fn(model: Any, src: Any, tgt: Any):
    import torch

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        out = model(src, tgt, None).dec_out
        logits = model.generator(out)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
        loss.backward()

    return step


def _attention_step(attention: Any, x: Any, mask: Any) -> None:
    out, _ = attention(x, attn_mask=mask)
    out.sum().backward()


def _tokens(B: int, n: int, vocab: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (B, n), generator=g)


def _translator(model: Any, workdir: str, beam: int, length: int, vocab: int) -> Any:
    from eole.config.run import PredictConfig
    from eole.predict import GNMTGlobalScorer, Translator

    os.environ["MODEL_PATH"] = workdir
    options: dict = dict(model_path=workdir, src="unused", beam_size=beam, n_best=1,
                         max_length=length, min_length=length, max_length_ratio=0,
                         length_penalty="none", alpha=0.0, seed=1, self_attn_backend="pytorch")
    if beam == 1:
        options["top_k"] = 1
    config = PredictConfig(**options)
    model_config = types.SimpleNamespace(add_estimator=False, estimator_type="average",
                                         encoder=model.encoder)
    return Translator(model.eval(), _vocabs(vocab), config, model_config=model_config,
                      device_id=-1, global_scorer=GNMTGlobalScorer.from_config(config),
                      report_score=False)


def decoding_error(model: Any, src: Any, workdir: str, length: int, vocab: int) -> float:
    """Largest |cached - teacher-forced| log-probability over a greedy translation."""
    import torch

    translator = _translator(model, workdir, 1, length, vocab)
    steps = []
    real = translator._decode_and_generate

    def record(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        steps.append(out[0].clone())
        return out

    translator._decode_and_generate = record
    results = translator.predict_batch({"src": src, "srclen": src.ne(PAD).sum(1)},
                                       attn_debug=False)
    tokens = torch.tensor([[int(t) for t in sent[0]] for sent in results["predictions"]])
    seq = torch.cat([torch.full((src.size(0), 1), BOS), tokens, tokens[:, :1]], 1)
    with torch.no_grad():
        out = model(src, seq, None).dec_out[:, : tokens.size(1)]
        full = torch.log_softmax(model.generator(out).float(), -1)
    return float((torch.stack(steps, 1) - full).abs().max())


# ----------------------------------------------------------------------------------------------
# Peak memory (each case in a fresh subprocess)


def prepare_memory(variant: str, layers: int, n: int, vocab: int, grad: bool):
    """Subprocess: build the model and a 2048-token document; return the call to measure."""
    import torch

    warnings.filterwarnings("ignore")
    model = build(layers, vocab, variant)
    src = _tokens(1, n, vocab, seed=5)
    tgt = _tokens(1, n + 1, vocab, seed=6)
    if grad:
        return _step_fn(model, src, tgt)
    model.eval()

    def forward() -> None:
        with torch.no_grad():
            model.generator(model(src, tgt, None).dec_out)

    return forward


# ----------------------------------------------------------------------------------------------
# The report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown report (and a .csv) here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    import torch

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    layers, vocab = (2, 1000) if args.quick else (6, VOCAB)
    lengths = (32, 64) if args.quick else (32, 64, 128, 256)
    tokens = 1024 if args.quick else 4096
    doc = 256 if args.quick else 2048
    beam, batch, length = (4, 4, 8) if args.quick else (4, 16, 32)
    started = time.perf_counter()
    models = {v: build(layers, vocab, v) for v in ("stock", "patched")}
    models["patched"].load_state_dict(models["stock"].state_dict())

    # Training steps, interleaved.
    cases: dict[tuple[int, str], list] = {}
    for n in lengths:
        B = tokens // n
        src, tgt = _tokens(B, n, vocab, seed=n), _tokens(B, n + 1, vocab, seed=n + 1)
        for variant, model in models.items():
            cases[(n, variant)] = [_step_fn(model, src, tgt)]

    def tick(case: tuple[int, str], round_: int) -> None:
        print(f"  training n={case[0]} {case[1]} round {round_}", file=sys.stderr, flush=True)

    train, failed = common.interleaved_medians(cases, warmup=1, repeats=args.rounds, tick=tick,
                                               rotate=True)
    assert not failed, failed

    # One self-attention layer (the part relpos replaces), forward + backward, interleaved.
    layer_cases: dict[tuple[int, str, str], list] = {}
    for n in lengths:
        B = tokens // n
        x = torch.randn(B, n, 512, requires_grad=True)
        masks = {"encoder": torch.ones(B, 1, 1, n, dtype=torch.bool),
                 "decoder": torch.ones(n, n, dtype=torch.bool).tril().expand(B, 1, n, n)}
        for variant, model in models.items():
            for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
                layer_cases[(n, side, variant)] = [functools.partial(
                    _attention_step, stack.transformer_layers[0].self_attn, x, masks[side])]
    layer, layer_failed = common.interleaved_medians(layer_cases, warmup=1,
                                                     repeats=args.rounds, rotate=True)
    assert not layer_failed, layer_failed

    # Translation (beam 4), interleaved.
    for model in models.values():
        model.eval()
        model.zero_grad(set_to_none=True)
    src = _tokens(batch, length, vocab, seed=7)
    workdir = tempfile.mkdtemp(prefix="relpos-eole-bench-")
    translators = {v: _translator(m, workdir, beam, length, vocab) for v, m in models.items()}
    batch_dict = {"src": src, "srclen": src.ne(PAD).sum(1)}
    outputs: dict[str, Any] = {}

    def translate(variant: str) -> None:
        outputs[variant] = translators[variant].predict_batch(batch_dict, attn_debug=False)

    translate_cases = {v: [functools.partial(translate, v)] for v in models}
    translation, translate_failed = common.interleaved_medians(translate_cases, warmup=1,
                                                               repeats=args.rounds, rotate=True)
    assert not translate_failed, translate_failed

    # How far cached decoding is from the full forward.
    errors = {v: decoding_error(m, src[:4], workdir, length, vocab) for v, m in models.items()}

    # Peak memory of a 2048-token document, fresh subprocesses.
    mem_cases = [("forward + backward", layers, True, ("patched",)),
                 ("forward + backward", 1, True, ("stock", "patched")),
                 ("forward, no grad", layers, False, ("stock", "patched"))]
    mem: list[tuple[str, int, str, float | str]] = []
    for what, n_layers, grad, variants in mem_cases:
        for variant in variants:
            print(f"  memory {what} {n_layers}+{n_layers} {variant}", file=sys.stderr, flush=True)
            prepare = functools.partial(prepare_memory, variant, n_layers, doc, vocab, grad)
            mem.append((what, n_layers, variant, memory.peak_mib(prepare, threads)))
    wall = time.perf_counter() - started

    meta = {"date": common.report_date(),
            "command": "OMP_WAIT_POLICY=PASSIVE " + common.script_command("relpos.bench.eole")
                       + (" --quick" if args.quick else "")
                       + (f" --out {args.out}" if args.out else ""),
            **common.environment(threads)}
    import eole

    meta["eole"] = eole.__version__ if hasattr(eole, "__version__") else "0.6.4"
    meta["wall time"] = f"{wall / 60:.1f} min"
    meta["load"] = f"1-min load average {os.getloadavg()[0]:.2f} at the end"
    lines = ["# eole Transformer NMT with Shaw relative positions: stock eole against relpos", "",
             *common.markdown_meta(meta), "",
             f"Model: {layers} + {layers} layers, d_model 512, 8 heads, FFN 2048, K = 20, "
             f"vocabulary {vocab}, float32, dropout 0, eole's xavier_uniform initialization.", "",
             f"## Training step (forward + loss + backward), about {tokens} source and {tokens} "
             "target tokens a batch", "",
             f"Median of {args.rounds} interleaved rounds (after one warm-up), the order rotating; "
             "on a busy machine absolute times swing, and the ratios, measured in the same "
             "rounds, are the figures to read.", ""]
    rows = []
    csv_rows = []
    for n in lengths:
        s, p = train[(n, "stock")][0], train[(n, "patched")][0]
        rows.append([f"{tokens // n} x {n}", common.format_ms(s), common.format_ms(p),
                     f"{s / p:.2f}x"])
        csv_rows.append(["train", f"{tokens // n}x{n}", f"{s:.1f}", f"{p:.1f}", f"{s / p:.3f}"])
    lines += common.markdown_table(["B x n", "stock eole (ms)", "patched (ms)",
                                    "speed-up (stock / patched)"], rows)
    rows = []
    for n in lengths:
        cells = [f"{tokens // n} x {n}"]
        for side in ("encoder", "decoder"):
            s, p = layer[(n, side, "stock")][0], layer[(n, side, "patched")][0]
            cells += [common.format_ms(s), common.format_ms(p), f"{s / p:.2f}x"]
            csv_rows.append([f"self-attention {side}", f"{tokens // n}x{n}", f"{s:.1f}",
                             f"{p:.1f}", f"{s / p:.3f}"])
        rows.append(cells)
    lines += ["", "### One self-attention layer, forward + backward (what the patch replaces)", "",
              "The first encoder layer's (padding mask) and the first decoder layer's (causal "
              "mask) self-attention module on its own, input (B, n, 512), same rounds scheme. "
              "The rest of a training step (linears, feed-forward, cross-attention, the output "
              "layer) is the same in both models.", ""]
    lines += common.markdown_table(["B x n", "encoder stock (ms)", "patched (ms)", "speed-up",
                                    "decoder stock (ms)", "patched (ms)", "speed-up"], rows)
    s, p = translation["stock"][0], translation["patched"][0]
    csv_rows.append(["translate", f"{batch}x{length} beam {beam}", f"{s:.1f}", f"{p:.1f}",
                     f"{s / p:.3f}"])
    same = all(
        [int(t) for t in a[0]] == [int(t) for t in b[0]]
        for a, b in zip(outputs["stock"]["predictions"], outputs["patched"]["predictions"],
                        strict=True))
    lines += ["", f"## Translation: eole's Translator, beam {beam}, {batch} sentences of "
              f"{length} tokens, {length} target tokens each", "",
              *common.markdown_table(["", "stock eole (ms)", "patched (ms)", "speed-up"],
                                     [["translate", common.format_ms(s), common.format_ms(p),
                                       f"{s / p:.2f}x"]]), "",
              f"The two give {'the same' if same else 'different'} translations (stock's cached "
              "decoding is wrong, see below).", "",
              "## Cached decoding against the full forward", "",
              "Greedy translation of 4 sentences through eole's Translator; the largest "
              "|log-probability with eole's cache - teacher-forced log-probability of the same "
              "tokens| over the vocabulary and every step:", "",
              *common.markdown_table(["", "max abs difference"],
                                     [[v, f"{errors[v]:.3g}"] for v in ("stock", "patched")]),
              "", f"## Peak memory of a {doc}-token document (source and target {doc} tokens, "
              "batch 1)", "", memory.METHOD + ".", ""]
    mem_rows = [[what, f"{n_layers} + {n_layers}", variant,
                 f"{value:.0f}" if isinstance(value, float) else str(value)]
                for what, n_layers, variant, value in mem]
    for what, n_layers, variant, value in mem:
        csv_rows.append([f"memory {what}", f"{n_layers}+{n_layers}", variant,
                         f"{value:.0f}" if isinstance(value, float) else value, ""])
    lines += common.markdown_table(["pass", "layers", "variant", "peak MiB"], mem_rows)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        csv = common.csv_text(["case", "shape", "stock ms / variant", "patched ms / MiB",
                               "ratio"], csv_rows)
        common.write_files({args.out: text, args.out.with_suffix(".csv"): csv})
    return 0


if __name__ == "__main__":
    sys.exit(main())
